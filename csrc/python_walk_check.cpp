// fused_ema._C.walk_matches / take: whether a walk of the model holds the very objects an update
// plan was built for, compared and indexed without allocating. Only object identity: what a tensor
// holds (dtype, shape, storage) is checked where it is read, by the prepared update or in Python.
#include <Python.h>

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

PyObject* python_walk_matches(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "walk_matches(walk, refs) takes 2 arguments (%zd)", nargs);
    return nullptr;
  }
  PyObject* walk = args[0];
  PyObject* refs = args[1];
  if (!check_type(walk, PyList_Check(walk), "a list (walk)") ||
      !check_type(refs, PyTuple_Check(refs), "a tuple (refs)")) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(walk);
  if (PyTuple_GET_SIZE(refs) != n) {
    Py_RETURN_FALSE;
  }
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
  }
  Py_RETURN_TRUE;
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
