// Declares the fused_ema operators, and the Python module fused_ema._C whose import loads this
// library (kernels register themselves from cpu/ and cuda/) and reports how it was built.
#include <Python.h>
#include <torch/headeronly/version.h>
#include <torch/library.h>

#include <iterator>
#include <string>
#include <vector>

#include "cpu/cpu_isa.h"
#include "dtype_pairs.h"
#include "fused_op.h"
#include "module_walk.h"
#include "schedule_formula.h"

#ifndef FUSED_EMA_WITH_CUDA
#define FUSED_EMA_WITH_CUDA 0
#endif

#if FUSED_EMA_WITH_CUDA
namespace fused_ema::cuda {
std::vector<int> compiled_archs();  // __CUDA_ARCH_LIST__ (800, 900, ...), cuda/fused_cuda.cu
int cuda_version_built();
}  // namespace fused_ema::cuda
#endif

namespace fused_ema {
// python_walk.cpp
PyObject* python_tensor_walk(PyObject* module, PyObject* args, PyObject* kwargs);
PyObject* python_named_walk(PyObject* module, PyObject* args);
PyObject* python_walk_matches(PyObject* module, PyObject* const* args, Py_ssize_t nargs);
// python_walk_cache.cpp
PyObject* python_walk_cache(PyObject* module, PyObject* const* args, Py_ssize_t nargs);
PyObject* python_walk_unchanged(PyObject* module, PyObject* const* args, Py_ssize_t nargs);
// prepared_handles.cpp
PyObject* python_run_prepared(PyObject* module, PyObject* const* args, Py_ssize_t nargs);
PyObject* python_prepared_free(PyObject* module, PyObject* handle);
PyObject* python_prepared_runs(PyObject* module, PyObject* handle);
// grad_mode.cpp
PyObject* python_without_grad(PyObject* module, PyObject* const* args, Py_ssize_t nargs);
// finish_all.cpp
PyObject* python_finish_all(PyObject* module, PyObject* steps);
}  // namespace fused_ema

namespace {

// The ops that write their tensors; fused_ema_checks declares each again, writing nothing.
constexpr const char* kWritingOps[] = {
    "lerp_(Tensor(a!)[] ema, Tensor[] src, Scalar weight) -> ()",
    "lerp_.Tensor(Tensor(a!)[] ema, Tensor[] src, Tensor weight) -> ()",
    // lerp_ with bfloat16/float16 EMAs rounded stochastically (stochastic_round.h): weight and
    // step are one-element tensors the kernels read; keys and offsets hold one entry per tensor.
    "lerp_stochastic_(Tensor(a!)[] ema, Tensor[] src, Tensor weight, Tensor step, int seed, "
    "int[] keys, int[] offsets) -> ()",
    // K EMA tracks of one list of sources, each track as lerp_ (lerp_stochastic_) with its own
    // weight, each source read once. Schemas take no list of lists: emas holds the tracks one
    // after another (track k's tensor i at k * len(src) + i); weights has K float32/float64
    // elements, seeds one per track, keys one per EMA tensor (as emas), offsets one per src.
    "lerp_many_(Tensor(a!)[] emas, Tensor[] src, Tensor weights) -> ()",
    "lerp_many_stochastic_(Tensor(a!)[] emas, Tensor[] src, Tensor weights, Tensor step, "
    "int[] seeds, int[] keys, int[] offsets) -> ()",
    // BEMA (bias-corrected EMA) of one list of sources, each read once: with weights = (beta, w0,
    // alpha), ema as lerp_ with beta, theta0 as lerp_ with w0, then out = ema + alpha * (src -
    // theta0) from the new values (fused_op.h); a weight of 0 leaves its list as it is.
    "bema_(Tensor(a!)[] ema, Tensor(b!)[] theta0, Tensor(c!)[] out, Tensor[] src, "
    "Tensor weights) -> ()",
    // ModelEma's step counter and decay schedule (schedule_formula.h); out = (weight, decay),
    // config = (decay, min_decay, warmup_gamma, ..., bias_power: schedule.cpp).
    "ema_schedule_(Tensor(a!) step, Tensor(b!) out, Tensor config, bool advance) -> ()",
};

// A schema without its alias annotations ("Tensor(a!)[]" -> "Tensor[]").
std::string without_writes(std::string schema) {
  for (size_t end = schema.find("!)"); end != std::string::npos; end = schema.find("!)")) {
    const size_t begin = schema.rfind('(', end);
    schema.erase(begin, end + 2 - begin);
  }
  return schema;
}

}  // namespace

TORCH_LIBRARY(fused_ema, m) {
  for (const char* schema : kWritingOps) {
    m.def(schema);
  }
  // A ModelEma update prepared once (prepared_update.h): made from its schedules' (step, out,
  // config) triples, given its fused calls (kind: 0 lerp_, 1 lerp_stochastic_, 2 lerp_many_,
  // 3 lerp_many_stochastic_, 4 bema_) and copies, then run by handle (fused_ema._C.run_prepared).
  m.def("prepared_new(Tensor[] schedules) -> int");
  m.def(
      "prepared_add_call(int handle, int kind, Tensor[] emas, Tensor[] src, Tensor weights, "
      "int[] joint, Tensor? step, int[] seeds, int[] keys, int[] offsets) -> ()");
  m.def("prepared_add_copies(int handle, Tensor[] dst, Tensor[] src, bool staging) -> ()");
  // ModelEma.swapped() (swap_values.cpp): a[i] and b[i] exchange values through the scratch
  // buffer of their dtype and device, unless state already holds `into` (0 or 1), which it
  // then does.
  m.def(
      "swap_values_(Tensor(a!)[] a, Tensor(b!)[] b, Tensor(c!)[] scratch, Tensor(d!) state, "
      "int into) -> ()");
}

// Each writing op's checks alone, for its fake kernel (fused_ema/_ext/op_meta.py).
TORCH_LIBRARY(fused_ema_checks, m) {
  for (const char* schema : kWritingOps) {
    m.def(without_writes(schema).c_str());
  }
}

namespace {

PyObject* string_tuple(const std::vector<std::string>& items) {
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(items.size()));
  for (size_t k = 0; tuple != nullptr && k < items.size(); ++k) {
    PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(k), PyUnicode_FromString(items[k].c_str()));
  }
  return tuple;
}

PyObject* devices_with_kernels(PyObject*, PyObject*) {
  return string_tuple(fused_ema::devices_with_kernels());
}

PyObject* cpu_isa(PyObject*, PyObject*) {
  return PyUnicode_FromString(fused_ema::cpu::active_isa().c_str());
}

PyObject* available_cpu_isas(PyObject*, PyObject*) {
  return string_tuple(fused_ema::cpu::available_isas());
}

PyObject* set_cpu_isa(PyObject*, PyObject* arg) {
  return fused_ema::python_entry([&]() -> PyObject* {
    const char* name = PyUnicode_AsUTF8(arg);
    if (name == nullptr) {
      return nullptr;
    }
    fused_ema::cpu::set_active_isa(name);
    Py_RETURN_NONE;
  });
}

PyMethodDef kMethods[] = {
    {"devices_with_kernels", devices_with_kernels, METH_NOARGS,
     "Device types this build has lerp kernels for."},
    {"cpu_isa", cpu_isa, METH_NOARGS, "The CPU instruction set the kernels use now."},
    {"available_cpu_isas", available_cpu_isas, METH_NOARGS,
     "Instruction sets compiled in and supported by this CPU."},
    {"set_cpu_isa", set_cpu_isa, METH_O, "Select the CPU instruction set by name."},
    {"tensor_walk", reinterpret_cast<PyCFunction>(fused_ema::python_tensor_walk),
     METH_VARARGS | METH_KEYWORDS,
     "tensor_walk(model, with_buffers=True, names=False) -> list: per distinct module "
     "(depth-first pre-order, None children skipped), its _parameters values, then its "
     "persistent _buffers values; None entries kept. names=True: (list, hash of the names)."},
    {"named_walk", fused_ema::python_named_walk, METH_VARARGS,
     "named_walk(model, with_buffers=True, every_path=False) -> list: tensor_walk's items as "
     "(full name, value, is_parameter), each module's names prefixed as named_modules first "
     "reaches it; every_path=True: a module reachable by several paths is walked along each, "
     "as state_dict() names it."},
    {"walk_matches", reinterpret_cast<PyCFunction>(fused_ema::python_walk_matches), METH_FASTCALL,
     "walk_matches(walk: list, refs: tuple) -> bool: every refs[i] is None with walk[i] None or a "
     "weakref.ref to walk[i] itself."},
    {"walk_cache", reinterpret_cast<PyCFunction>(fused_ema::python_walk_cache), METH_FASTCALL,
     "walk_cache(model, with_buffers: bool, walk: list) -> capsule | None: what tensor_walk "
     "read to find `walk`, for walk_unchanged (None where it cannot be cached)."},
    {"walk_unchanged", reinterpret_cast<PyCFunction>(fused_ema::python_walk_unchanged),
     METH_FASTCALL,
     "walk_unchanged(cache, model) -> list | None: the cached walk, as a new list, if nothing it "
     "read changed; else None."},
    {"run_prepared", reinterpret_cast<PyCFunction>(fused_ema::python_run_prepared), METH_FASTCALL,
     "run_prepared(handle, cache, model, mode, step, replan) -> bool: one update by a prepared "
     "plan (mode 0 advance, 1 set to step, 2 keep the counters); False, having changed nothing, "
     "when the walk cache (if given) finds the model changed or, without replan, a tensor is no "
     "longer what was planned."},
    {"prepared_runs", fused_ema::python_prepared_runs, METH_O,
     "prepared_runs(handle) -> int: the runs of a prepared update that have completed."},
    {"prepared_free", fused_ema::python_prepared_free, METH_O,
     "prepared_free(handle): drops a prepared update and the tensors it holds."},
    {"without_grad", reinterpret_cast<PyCFunction>(fused_ema::python_without_grad), METH_FASTCALL,
     "without_grad(fn, *args) -> fn(*args) with autograd off; the caller's grad mode is restored "
     "on every way out (exceptions and interrupts included) with no Python code in between."},
    {"finish_all", fused_ema::python_finish_all, METH_O,
     "finish_all(steps): calls each step in order; one interrupted runs again (up to 16 times), "
     "one that fails once more, then the next runs; raises the first error after the last step."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_C", "fused_ema's compiled kernels", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__C() {
  PyObject* module = PyModule_Create(&kModule);
  if (module == nullptr) {
    return nullptr;
  }
  PyModule_AddStringConstant(
      module, "TORCH_VERSION_BUILT",
      (std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
       std::to_string(TORCH_VERSION_PATCH))
          .c_str());
  PyObject* pairs = PyTuple_New(static_cast<Py_ssize_t>(std::size(fused_ema::kPairs)));
  for (size_t k = 0; pairs != nullptr && k < std::size(fused_ema::kPairs); ++k) {
    const auto& pair = fused_ema::kPairs[k];
    PyTuple_SET_ITEM(pairs, static_cast<Py_ssize_t>(k),
                     Py_BuildValue("(ss)", fused_ema::dtype_name(pair.ema).c_str(),
                                   fused_ema::dtype_name(pair.src).c_str()));
  }
  PyModule_AddObject(module, "DTYPE_PAIRS", pairs);
  PyModule_AddObject(module, "MAX_STEP", PyLong_FromLongLong(fused_ema::kMaxStep));
  PyModule_AddObject(module, "COMPILED_CPU_ISAS", string_tuple(fused_ema::cpu::compiled_isas()));
#if FUSED_EMA_WITH_CUDA
  std::vector<std::string> archs;
  for (int arch : fused_ema::cuda::compiled_archs()) {
    archs.push_back(std::to_string(arch / 100) + "." + std::to_string(arch % 100 / 10));
  }
  PyModule_AddObject(module, "CUDA_ARCHS", string_tuple(archs));
  const int version = fused_ema::cuda::cuda_version_built();
  PyModule_AddStringConstant(
      module, "CUDA_VERSION_BUILT",
      (std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10)).c_str());
#else
  PyModule_AddObject(module, "CUDA_ARCHS", PyTuple_New(0));
  Py_INCREF(Py_None);
  PyModule_AddObject(module, "CUDA_VERSION_BUILT", Py_None);
#endif
  return module;
}
