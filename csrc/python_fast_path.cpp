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
#include <torch/csrc/utils/object_ptr.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <vector>

#include "lerp_op.h"

namespace fused_ema {
namespace {

// A tensor the dispatcher would send straight to our CPU or CUDA kernel: exactly a Tensor or a
// Parameter (whose __torch_function__ is disabled), with no keys beyond backend and autograd.
bool plain_tensor(PyObject* obj) {
  const auto* type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
  if (type != THPVariableClass && type != ParameterClass) {
    return false;
  }
  const auto keys = THPVariable_Unpack(obj).key_set() -
                    c10::autograd_dispatch_keyset_with_ADInplaceOrView -
                    c10::autocast_dispatch_keyset;
  return keys == c10::DispatchKeySet(c10::DispatchKey::CPU) ||
         keys == c10::DispatchKeySet(c10::DispatchKey::CUDA);
}

// Borrowed tensor pointers of a tuple of plain tensors, or false if one is not plain.
bool unpack_plain(PyObject* tuple, std::vector<const at::Tensor*>& out) {
  const Py_ssize_t n = PyTuple_GET_SIZE(tuple);
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyTuple_GET_ITEM(tuple, i);
    if (!plain_tensor(item)) {
      return false;
    }
    out[static_cast<size_t>(i)] = &THPVariable_Unpack(item);
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
  // Tuples own a reference to every tensor, so the lists may change while the GIL is released.
  THPObjectPtr ema_tuple(PySequence_Tuple(ema_list));
  THPObjectPtr src_tuple(PySequence_Tuple(src_list));
  if (!ema_tuple || !src_tuple) {
    return nullptr;
  }
  std::vector<const at::Tensor*> ema;
  std::vector<const at::Tensor*> src;
  if (!unpack_plain(ema_tuple.get(), ema) || !unpack_plain(src_tuple.get(), src)) {
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
