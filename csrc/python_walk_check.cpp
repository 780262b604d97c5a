// fused_ema._C.walk_signature / walk_matches / take: whether a walk of the model holds the very
// tensor objects (and types, dtypes, devices, shapes) an update plan was built for, compared and
// indexed without allocating; walk_agrees: whether a compiled program's values line up with it.
#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "walk_item.h"

namespace fused_ema {
namespace {

bool check_type(PyObject* obj, bool ok, const char* what) {
  if (!ok) {
    PyErr_Format(PyExc_TypeError, "expected %s, got %.200s", what, Py_TYPE(obj)->tp_name);
  }
  return ok;
}

// The referent of a weakref.ref, compared by address only (never dereferenced).
PyObject* referent(PyObject* ref) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* target = nullptr;
  if (PyWeakref_GetRef(ref, &target) < 0) {
    PyErr_Clear();
    return nullptr;
  }
  Py_XDECREF(target);
  return target;
#else
  PyObject* target = PyWeakref_GET_OBJECT(ref);
  return target == Py_None ? nullptr : target;
#endif
}

}  // namespace

PyObject* python_walk_signature(PyObject* /*module*/, PyObject* walk) {
  HANDLE_TH_ERRORS
  if (!check_type(walk, PyList_Check(walk), "a list")) {
    return nullptr;
  }
  std::vector<char> bytes;
  bytes.reserve(static_cast<size_t>(PyList_GET_SIZE(walk)) * (sizeof(ItemHeader) + 16));
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(walk); ++i) {
    if (!append_signature(PyList_GET_ITEM(walk, i), bytes)) {
      return nullptr;
    }
  }
  return PyBytes_FromStringAndSize(bytes.data(), static_cast<Py_ssize_t>(bytes.size()));
  END_HANDLE_TH_ERRORS
}

PyObject* python_walk_matches(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "walk_matches(walk, refs, signature) takes 3 arguments (%zd)",
                 nargs);
    return nullptr;
  }
  PyObject* walk = args[0];
  PyObject* refs = args[1];
  PyObject* signature = args[2];
  if (!check_type(walk, PyList_Check(walk), "a list (walk)") ||
      !check_type(refs, PyTuple_Check(refs), "a tuple (refs)") ||
      !check_type(signature, PyBytes_Check(signature), "bytes (signature)")) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(walk);
  if (PyTuple_GET_SIZE(refs) != n) {
    Py_RETURN_FALSE;
  }
  const char* cursor = PyBytes_AS_STRING(signature);
  const char* const end = cursor + PyBytes_GET_SIZE(signature);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(walk, i);
    PyObject* ref = PyTuple_GET_ITEM(refs, i);
    if (ref == Py_None) {
      if (item != Py_None) {
        Py_RETURN_FALSE;
      }
    } else {
      if (!check_type(ref, PyWeakref_CheckRef(ref), "weakref.ref or None (refs item)")) {
        return nullptr;
      }
      if (item == Py_None || referent(ref) != item) {
        Py_RETURN_FALSE;
      }
    }
    bool error = false;
    if (!item_matches(item, cursor, end, error)) {
      if (error) {
        return nullptr;
      }
      Py_RETURN_FALSE;
    }
  }
  if (cursor != end) {
    Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

PyObject* python_walk_agrees(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "walk_agrees(values, walk) takes 2 arguments (%zd)", nargs);
    return nullptr;
  }
  PyObject* values = args[0];
  PyObject* walk = args[1];
  if (!check_type(values, PyList_Check(values), "a list (values)") ||
      !check_type(walk, PyList_Check(walk), "a list (walk)")) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(walk);
  if (PyList_GET_SIZE(values) != n) {
    Py_RETURN_FALSE;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    ItemHeader ours;
    ItemHeader theirs;
    c10::IntArrayRef our_sizes;
    c10::IntArrayRef their_sizes;
    if (!describe_item(PyList_GET_ITEM(values, i), ours, our_sizes) ||
        !describe_item(PyList_GET_ITEM(walk, i), theirs, their_sizes)) {
      return nullptr;
    }
    // A compiled program passes plain tensors where the model holds parameters: the Python type
    // is left out, a None against a tensor is not.
    if ((ours.type == 0) != (theirs.type == 0)) {
      Py_RETURN_FALSE;
    }
    ours.type = theirs.type = 0;
    if (std::memcmp(&ours, &theirs, sizeof(ours)) != 0 || our_sizes != their_sizes) {
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

PyObject* python_take(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "take(walk, indices) takes 2 arguments (%zd)", nargs);
    return nullptr;
  }
  PyObject* walk = args[0];
  PyObject* indices = args[1];
  if (!check_type(walk, PyList_Check(walk), "a list (walk)") ||
      !check_type(indices, PyTuple_Check(indices), "a tuple of ints (indices)")) {
    return nullptr;
  }
  const Py_ssize_t size = PyList_GET_SIZE(walk);
  const Py_ssize_t n = PyTuple_GET_SIZE(indices);
  PyObject* out = PyList_New(n);
  if (out == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t k = 0; k < n; ++k) {
    Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(indices, k));
    if (i == -1 && PyErr_Occurred()) {
      Py_DECREF(out);
      return nullptr;
    }
    if (i < 0) {
      i += size;  // as walk[i] does
    }
    if (i < 0 || i >= size) {
      Py_DECREF(out);
      PyErr_Format(PyExc_IndexError, "take: index %zd out of range for a walk of %zd items",
                   PyLong_AsSsize_t(PyTuple_GET_ITEM(indices, k)), size);
      return nullptr;
    }
    PyObject* item = PyList_GET_ITEM(walk, i);
    Py_INCREF(item);
    PyList_SET_ITEM(out, k, item);
  }
  return out;
}

}  // namespace fused_ema
