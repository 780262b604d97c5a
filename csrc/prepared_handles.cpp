// Prepared updates by handle: the ops that make them (prepared_new, prepared_add_call,
// prepared_add_copies), which hand them the tensors once through the dispatcher, and
// fused_ema._C.run_prepared / prepared_runs / prepared_free, which reach them by handle with no
// tensor crossing from Python. The registry is the only state here.
#include <Python.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "module_walk.h"
#include "prepared_update.h"

namespace fused_ema {

bool walk_cache_fresh(PyObject* cache, PyObject* model);  // python_walk_cache.cpp

namespace {

struct Registry {
  std::mutex mutex;
  std::unordered_map<int64_t, std::shared_ptr<PreparedUpdate>> items;
  int64_t next = 1;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: handles may be freed at exit
  return *r;
}

int64_t prepared_new(at::TensorList schedules) {
  auto prepared = std::make_shared<PreparedUpdate>(schedules.vec());
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  const int64_t handle = r.next++;
  r.items.emplace(handle, std::move(prepared));
  return handle;
}

std::shared_ptr<PreparedUpdate> find_prepared(int64_t handle) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.items.find(handle);
  return it == r.items.end() ? nullptr : it->second;
}

std::shared_ptr<PreparedUpdate> found(int64_t handle) {
  std::shared_ptr<PreparedUpdate> prepared = find_prepared(handle);
  TORCH_CHECK_VALUE(prepared != nullptr, kPreparedOp, "no prepared update ", handle);
  return prepared;
}

void prepared_add_call(int64_t handle, int64_t kind, at::TensorList emas, at::TensorList src,
                       const at::Tensor& weights, at::IntArrayRef joint,
                       const std::optional<at::Tensor>& step, at::IntArrayRef seeds,
                       at::IntArrayRef keys, at::IntArrayRef offsets) {
  TORCH_CHECK_VALUE(kind >= 0 && kind <= static_cast<int64_t>(FusedKind::kBema), kPreparedOp,
                    "unknown kind ", kind);
  PreparedCall call;
  call.kind = static_cast<FusedKind>(kind);
  call.emas = emas.vec();
  call.src = src.vec();
  call.weights = weights;
  call.joint = joint.vec();
  TORCH_CHECK_VALUE(step.has_value() == is_stochastic(call.kind), kPreparedOp,
                    "a step goes with the stochastic kinds");
  if (step.has_value()) {
    call.step = *step;
  }
  call.seeds = seeds.vec();
  call.keys = keys.vec();
  call.offsets = offsets.vec();
  found(handle)->add_call(std::move(call));
}

void prepared_add_copies(int64_t handle, at::TensorList dst, at::TensorList src, bool staging) {
  found(handle)->add_copies(dst.vec(), src.vec(), staging);
}

// The GIL released while this lives, however its scope is left.
struct WithoutGil {
  PyThreadState* state = PyEval_SaveThread();
  ~WithoutGil() { PyEval_RestoreThread(state); }
};

}  // namespace

void set_python_error(const std::exception& err) {
  if (dynamic_cast<const std::bad_alloc*>(&err) != nullptr) {
    PyErr_NoMemory();
    return;
  }
  PyObject* type = PyExc_RuntimeError;
  const char* message = err.what();
  // The standard types as pybind11 (and torch's stable kernels up to 2.13) raise them; the code
  // on torch's stable ABI has no c10 types to throw.
  if (dynamic_cast<const std::invalid_argument*>(&err) != nullptr ||
      dynamic_cast<const std::domain_error*>(&err) != nullptr) {
    type = PyExc_ValueError;
  } else if (dynamic_cast<const std::out_of_range*>(&err) != nullptr) {
    type = PyExc_IndexError;
  } else if (const auto* e = dynamic_cast<const c10::Error*>(&err)) {
    message = e->what_without_backtrace();
    if (dynamic_cast<const c10::ValueError*>(&err) != nullptr) {
      type = PyExc_ValueError;
    } else if (dynamic_cast<const c10::TypeError*>(&err) != nullptr) {
      type = PyExc_TypeError;
    } else if (dynamic_cast<const c10::IndexError*>(&err) != nullptr) {
      type = PyExc_IndexError;
    } else if (dynamic_cast<const c10::NotImplementedError*>(&err) != nullptr) {
      type = PyExc_NotImplementedError;
    }
  }
  PyErr_SetString(type, message);
}

// run_prepared(handle, cache, model, mode, step, replan) -> bool: with a walk cache (3.12+), first
// whether `model` is unchanged since it was made (else False); then PreparedUpdate::run with the
// GIL released.
PyObject* python_run_prepared(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError,
                    "run_prepared(handle, cache, model, mode: int, step: int, replan: bool)");
    return nullptr;
  }
  const int64_t handle = PyLong_AsLongLong(args[0]);
  const int64_t mode = PyLong_AsLongLong(args[3]);
  const int64_t step = PyLong_AsLongLong(args[4]);
  const int replan = PyObject_IsTrue(args[5]);
  if (PyErr_Occurred() || replan < 0) {
    return nullptr;
  }
  if (args[1] != Py_None && !walk_cache_fresh(args[1], args[2])) {
    if (PyErr_Occurred()) {
      return nullptr;
    }
    Py_RETURN_FALSE;
  }
  std::shared_ptr<PreparedUpdate> prepared = find_prepared(handle);
  if (prepared == nullptr || mode < 0 || mode > static_cast<int64_t>(StepMode::kKeep)) {
    PyErr_Format(PyExc_ValueError, "run_prepared: no prepared update %lld or mode %lld",
                 static_cast<long long>(handle), static_cast<long long>(mode));
    return nullptr;
  }
  return python_entry([&]() -> PyObject* {
    bool ran = false;
    {
      const WithoutGil released;
      ran = prepared->run(static_cast<StepMode>(mode), step, replan != 0);
    }
    return PyBool_FromLong(ran);
  });
}

PyObject* python_prepared_runs(PyObject* /*module*/, PyObject* handle) {
  const int64_t h = PyLong_AsLongLong(handle);
  if (PyErr_Occurred()) {
    return nullptr;
  }
  const std::shared_ptr<PreparedUpdate> prepared = find_prepared(h);
  return PyLong_FromLongLong(prepared == nullptr ? -1 : prepared->runs());
}

PyObject* python_prepared_free(PyObject* /*module*/, PyObject* handle) {
  const int64_t h = PyLong_AsLongLong(handle);
  if (PyErr_Occurred()) {
    return nullptr;
  }
  std::shared_ptr<PreparedUpdate> freed;  // released outside the lock
  {
    Registry& r = registry();
    const std::lock_guard<std::mutex> lock(r.mutex);
    const auto it = r.items.find(h);
    if (it != r.items.end()) {
      freed = std::move(it->second);
      r.items.erase(it);
    }
  }
  Py_RETURN_NONE;
}

}  // namespace fused_ema

TORCH_LIBRARY_IMPL(fused_ema, CompositeExplicitAutograd, m) {
  m.impl("prepared_new", &fused_ema::prepared_new);
  m.impl("prepared_add_call", &fused_ema::prepared_add_call);
  m.impl("prepared_add_copies", &fused_ema::prepared_add_copies);
}
