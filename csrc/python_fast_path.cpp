// fused_ema._C._lerp_eager, _lerp_many_eager and _bema_eager: run the lerp, lerp_many and bema
// drivers straight from Python lists of plain tensors.
// The dispatcher's boxed call copies every tensor into IValues and back (reference counts and
// PyObject bookkeeping, ~0.4 us a tensor: most of the cost of a 20,000-tensor update). This
// path declines, returning False, whenever the dispatcher has work to do: tensor subclasses,
// __torch_function__ overrides, dispatch modes, functorch transforms, non-dense tensors.
#include <ATen/PythonTorchFunctionTLS.h>
#include <Python.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <cstddef>
#include <exception>
#include <optional>
#include <vector>

#include "bema_op.h"
#include "lerp_many.h"
#include "lerp_op.h"
#include "lerp_plan.h"

namespace fused_ema {
namespace {

// A tensor the dispatcher would send straight to our CPU or CUDA kernel: exactly a Tensor or a
// Parameter (whose __torch_function__ is disabled), with no keys beyond backend and autograd.
bool plain_tensor(PyObject* obj) {
  if (!THPVariable_CheckExact(obj)) {
    return false;
  }
  const auto keys = THPVariable_Unpack(obj).key_set() -
                    c10::autograd_dispatch_keyset_with_ADInplaceOrView -
                    c10::autocast_dispatch_keyset;
  return keys == c10::DispatchKeySet(c10::DispatchKey::CPU) ||
         keys == c10::DispatchKeySet(c10::DispatchKey::CUDA);
}

// A long list's metadata has left the cache since the last call. Each tensor is fetched in
// stages, each a few tensors further ahead than the object its address is read from: kAhead * 2:
// the Python object's first line, * 1: its TensorImpl (whole: no assumption on its layout).
constexpr size_t kAhead = 8;

[[gnu::always_inline]] inline void prefetch_ahead(PyObject* const* items, size_t i, size_t n) {
  if (i + 2 * kAhead < n) {
    __builtin_prefetch(items[i + 2 * kAhead], 1);
  }
  if (i + kAhead < n && THPVariable_CheckExact(items[i + kAhead])) {
    prefetch_tensor_impl(THPVariable_Unpack(items[i + kAhead]).unsafeGetTensorImpl());
  }
}

// Strong references to the tensors of both lists, so that they outlive a release of the GIL
// whatever happens to the lists meanwhile; they are dropped (GIL held) when this goes.
class OwnedItems {
 public:
  OwnedItems() = default;
  OwnedItems(const OwnedItems&) = delete;
  OwnedItems& operator=(const OwnedItems&) = delete;
  ~OwnedItems() {
    const std::vector<PyObject*>& items = items_.vec;
    const size_t n = items.size();
    for (size_t i = 0; i < n; ++i) {
      if (i + kDropAhead < n) {
        __builtin_prefetch(items[i + kDropAhead], 1);
      }
      Py_DECREF(items[i]);
    }
  }

  void reserve(size_t n) { items_.vec.reserve(n); }
  void take(PyObject* item) {
    Py_INCREF(item);
    items_.vec.push_back(item);
  }

 private:
  static constexpr size_t kDropAhead = 24;
  Scratch<PyObject*, 0> items_;
};

// Whether every item of items[begin, n) is a plain tensor.
bool all_plain(PyObject* const* ema, PyObject* const* src, size_t begin, size_t n) {
  for (size_t i = begin; i < n; ++i) {
    if (!plain_tensor(ema[i]) || !plain_tensor(src[i])) {
      return false;
    }
  }
  return true;
}

// K Python numbers (floats, or ints that are not bools) as doubles; false where an item is not.
bool host_weights(PyObject* list, size_t tracks, std::vector<double>& values) {
  if (!(PyList_Check(list) || PyTuple_Check(list)) ||
      static_cast<size_t>(PySequence_Fast_GET_SIZE(list)) != tracks) {
    return false;
  }
  PyObject* const* items = PySequence_Fast_ITEMS(list);
  values.resize(tracks);
  for (size_t k = 0; k < tracks; ++k) {
    if (PyFloat_Check(items[k])) {
      values[k] = PyFloat_AS_DOUBLE(items[k]);
    } else if (PyLong_Check(items[k]) && !PyBool_Check(items[k])) {
      values[k] = PyLong_AsDouble(items[k]);
      if (values[k] == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
      }
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace

PyObject* python_lerp_eager(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* ema_list = nullptr;
  PyObject* src_list = nullptr;
  PyObject* weight = nullptr;
  if (!PyArg_ParseTuple(args, "OOO", &ema_list, &src_list, &weight)) {
    return nullptr;
  }
  if (!PyList_Check(ema_list) || !PyList_Check(src_list) ||
      PyList_GET_SIZE(ema_list) != PyList_GET_SIZE(src_list) ||
      !(c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty() ||
      at::impl::torch_function_mode_enabled()) {
    Py_RETURN_FALSE;
  }
  // A Python number becomes the Scalar the dispatcher would make of it (lerp checks its type).
  std::optional<c10::Scalar> number;
  if (PyBool_Check(weight)) {
    number = c10::Scalar(weight == Py_True);
  } else if (PyLong_Check(weight)) {
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(weight, &overflow);
    if (overflow != 0 || (value == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      Py_RETURN_FALSE;
    }
    number = c10::Scalar(static_cast<int64_t>(value));
  } else if (PyFloat_Check(weight)) {
    number = c10::Scalar(PyFloat_AS_DOUBLE(weight));
  } else if (!plain_tensor(weight)) {
    Py_RETURN_FALSE;
  }
  const auto n = static_cast<size_t>(PyList_GET_SIZE(ema_list));
  PyObject* const* ema = PySequence_Fast_ITEMS(ema_list);
  PyObject* const* src = PySequence_Fast_ITEMS(src_list);
  OwnedItems owned;
  owned.reserve(2 * n);
  LerpPlanner planner(n, /*row_major=*/false);
  const bool far = n >= kPrefetchFrom;
  // A pair the planner refuses is reported only once the rest are known to be plain tensors (else
  // the dispatcher decides) and the weight has been checked, as the dispatcher's route orders it.
  std::exception_ptr refused;
  for (size_t i = 0; i < n; ++i) {
    if (far) {
      prefetch_ahead(ema, i, n);
      prefetch_ahead(src, i, n);
    }
    owned.take(ema[i]);
    owned.take(src[i]);
    if (!plain_tensor(ema[i]) || !plain_tensor(src[i])) {
      Py_RETURN_FALSE;
    }
    try {
      planner.add(THPVariable_Unpack(ema[i]), THPVariable_Unpack(src[i]));
    } catch (const c10::Error&) {
      if (!all_plain(ema, src, i + 1, n)) {
        Py_RETURN_FALSE;
      }
      refused = std::current_exception();
      break;
    }
  }
  const LerpWeight checked =
      number.has_value() ? checked_weight(*number) : checked_weight(THPVariable_Unpack(weight));
  if (refused) {
    std::rethrow_exception(refused);
  }
  {
    pybind11::gil_scoped_release no_gil;
    run_plans(planner.finish([&](const DevicePlan& plan) { check_runnable(plan, checked); }),
              checked);
  }
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

// As python_lerp_eager, over K lists of N EMA tensors and one list of N sources, planned track by
// track as plan_lerp_many plans the dispatcher's lists.
PyObject* python_lerp_many_eager(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* emas_list = nullptr;
  PyObject* src_list = nullptr;
  PyObject* weights = nullptr;
  if (!PyArg_ParseTuple(args, "OOO", &emas_list, &src_list, &weights)) {
    return nullptr;
  }
  if (!PyList_Check(emas_list) || !PyList_Check(src_list) || PyList_GET_SIZE(emas_list) == 0 ||
      !(c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty() ||
      at::impl::torch_function_mode_enabled()) {
    Py_RETURN_FALSE;
  }
  const auto tracks = static_cast<size_t>(PyList_GET_SIZE(emas_list));
  const auto n = static_cast<size_t>(PyList_GET_SIZE(src_list));
  std::vector<PyObject* const*> emas(tracks);
  for (size_t k = 0; k < tracks; ++k) {
    PyObject* track = PyList_GET_ITEM(emas_list, k);
    if (!PyList_Check(track) || static_cast<size_t>(PyList_GET_SIZE(track)) != n) {
      Py_RETURN_FALSE;
    }
    emas[k] = PySequence_Fast_ITEMS(track);
  }
  std::vector<double> values;
  const bool numbers = host_weights(weights, tracks, values);
  if (!numbers && !plain_tensor(weights)) {
    Py_RETURN_FALSE;
  }
  PyObject* const* src = PySequence_Fast_ITEMS(src_list);
  OwnedItems owned;
  owned.reserve((tracks + 1) * n);
  LerpPlanner planner(tracks * n, /*row_major=*/false, {"fused_ema.lerp_many_: ", n});
  const bool far = n >= kPrefetchFrom;
  // A refused pair waits for the rest to be known plain and the weights checked (see above).
  std::exception_ptr refused;
  for (size_t k = 0; k < tracks && !refused; ++k) {
    for (size_t i = 0; i < n; ++i) {
      if (far) {
        prefetch_ahead(emas[k], i, n);
        prefetch_ahead(src, i, n);
      }
      if (k == 0) {
        owned.take(src[i]);
      }
      owned.take(emas[k][i]);
      if (!plain_tensor(emas[k][i]) || !plain_tensor(src[i])) {
        Py_RETURN_FALSE;
      }
      try {
        planner.add(THPVariable_Unpack(emas[k][i]), THPVariable_Unpack(src[i]), k * n + i);
      } catch (const c10::Error&) {
        for (size_t rest = k; rest < tracks; ++rest) {
          if (!all_plain(emas[rest], src, rest == k ? i + 1 : 0, n)) {
            Py_RETURN_FALSE;
          }
        }
        refused = std::current_exception();
        break;
      }
    }
  }
  const TrackWeights checked = numbers ? checked_track_weights(std::move(values))
                                       : checked_track_weights(THPVariable_Unpack(weights), tracks);
  if (refused) {
    std::rethrow_exception(refused);
  }
  {
    pybind11::gil_scoped_release no_gil;
    run_track_plans(
        planner.finish([&](const DevicePlan& plan) { check_tracks_runnable(plan, checked); }), n,
        checked);
  }
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

// bema_(ema, theta0, out, src, weights) on four lists of plain tensors and weights of 3 Python
// numbers or a plain tensor; False, having done nothing, where the dispatcher is needed. The
// driver gets the tensors as they lie in the lists (bema's own checks and planner).
PyObject* python_bema_eager(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* lists[4] = {nullptr, nullptr, nullptr, nullptr};
  PyObject* weights = nullptr;
  if (!PyArg_ParseTuple(args, "OOOOO", &lists[0], &lists[1], &lists[2], &lists[3], &weights)) {
    return nullptr;
  }
  if (!(c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty() ||
      at::impl::torch_function_mode_enabled()) {
    Py_RETURN_FALSE;
  }
  for (PyObject* list : lists) {
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != PyList_GET_SIZE(lists[3])) {
      Py_RETURN_FALSE;
    }
  }
  std::vector<double> values;
  const bool numbers = host_weights(weights, 3, values);
  if (!numbers && !plain_tensor(weights)) {
    Py_RETURN_FALSE;
  }
  const auto n = static_cast<size_t>(PyList_GET_SIZE(lists[3]));
  OwnedItems owned;
  owned.reserve(4 * n);
  std::vector<const at::Tensor*> refs[4];
  for (int k = 0; k < 4; ++k) {
    PyObject* const* items = PySequence_Fast_ITEMS(lists[k]);
    refs[k].reserve(n);
    for (size_t i = 0; i < n; ++i) {
      owned.take(items[i]);
      if (!plain_tensor(items[i])) {
        Py_RETURN_FALSE;
      }
      refs[k].push_back(&THPVariable_Unpack(items[i]));
    }
  }
  const double host[3] = {numbers ? values[0] : 0.0, numbers ? values[1] : 0.0,
                          numbers ? values[2] : 0.0};
  const BemaWeights checked =
      numbers ? checked_bema_weights(host) : checked_bema_weights(THPVariable_Unpack(weights));
  {
    pybind11::gil_scoped_release no_gil;
    bema(refs[0], refs[1], refs[2], refs[3], checked);
  }
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

}  // namespace fused_ema
