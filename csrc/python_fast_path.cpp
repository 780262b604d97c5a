// fused_ema._C._lerp_eager: runs the lerp driver straight from Python lists of plain tensors.
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

#include <optional>
#include <vector>

#include "lerp_op.h"

namespace fused_ema {
namespace {

// A tensor the dispatcher would send straight to our CPU or CUDA kernel: exactly a Tensor or a
// Parameter (whose __torch_function__ is disabled), with no keys beyond backend and autograd.
bool tensor_type(PyObject* obj) {
  const auto* type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
  return type == THPVariableClass || type == ParameterClass;
}

bool plain_tensor(PyObject* obj) {
  if (!tensor_type(obj)) {
    return false;
  }
  const auto keys = THPVariable_Unpack(obj).key_set() -
                    c10::autograd_dispatch_keyset_with_ADInplaceOrView -
                    c10::autocast_dispatch_keyset;
  return keys == c10::DispatchKeySet(c10::DispatchKey::CPU) ||
         keys == c10::DispatchKeySet(c10::DispatchKey::CUDA);
}

// The dispatch keys are all this pass reads of a TensorImpl. Prefetching the whole of it did not
// help plan_lerp's later pass (past a few thousand tensors the L2 cache no longer holds them) but
// spent fill buffers the next misses were waiting for.
struct KeySetAccess : c10::TensorImpl {
  using c10::TensorImpl::key_set_;
};
[[gnu::always_inline]] inline void prefetch_key_set(const c10::TensorImpl* impl) {
  __builtin_prefetch(&(impl->*&KeySetAccess::key_set_));
}

// Strong references to the items of a list, so that the tensors outlive a release of the GIL
// whatever happens to the list meanwhile; they are dropped (GIL held) when this goes.
template <int kPool>
class OwnedItems {
 public:
  OwnedItems() = default;
  OwnedItems(const OwnedItems&) = delete;
  OwnedItems& operator=(const OwnedItems&) = delete;
  ~OwnedItems() {
    const std::vector<PyObject*>& items = items_.vec;
    const size_t n = items.size();
    for (size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) {
        __builtin_prefetch(items[i + kAhead], 1);
      }
      Py_DECREF(items[i]);
    }
  }

  // Takes a reference to every item of `list` and returns false if one is not a plain tensor
  // (the references taken so far are dropped with this object). Each PyObject, then its
  // TensorImpl's dispatch keys, are prefetched ahead: a long list has left the cache since.
  bool take_plain(PyObject* list, std::vector<const at::Tensor*>& out) {
    const auto n = static_cast<size_t>(PyList_GET_SIZE(list));
    PyObject** items = reinterpret_cast<PyListObject*>(list)->ob_item;
    items_.vec.reserve(n);
    out.resize(n);
    for (size_t i = 0; i < n; ++i) {
      if (i + 2 * kAhead < n) {
        prefetch_bytes(items[i + 2 * kAhead], sizeof(THPVariable), /*write=*/1);
      }
      if (i + kAhead < n && tensor_type(items[i + kAhead])) {
        prefetch_key_set(THPVariable_Unpack(items[i + kAhead]).unsafeGetTensorImpl());
      }
      PyObject* item = items[i];
      Py_INCREF(item);
      items_.vec.push_back(item);
      if (!plain_tensor(item)) {
        return false;
      }
      out[i] = &THPVariable_Unpack(item);
    }
    return true;
  }

 private:
  static constexpr size_t kAhead = 24;
  Scratch<PyObject*, kPool> items_;
};

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
  OwnedItems<0> owned_ema;
  OwnedItems<1> owned_src;
  Scratch<const at::Tensor*, 0> ema_scratch;
  Scratch<const at::Tensor*, 1> src_scratch;
  std::vector<const at::Tensor*>& ema = ema_scratch.vec;
  std::vector<const at::Tensor*>& src = src_scratch.vec;
  if (!owned_ema.take_plain(ema_list, ema) || !owned_src.take_plain(src_list, src)) {
    Py_RETURN_FALSE;
  }
  if (number.has_value()) {
    pybind11::gil_scoped_release no_gil;
    lerp(ema, src, *number);
  } else {
    const at::Tensor& tensor = THPVariable_Unpack(weight);
    pybind11::gil_scoped_release no_gil;
    lerp(ema, src, tensor);
  }
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

}  // namespace fused_ema
