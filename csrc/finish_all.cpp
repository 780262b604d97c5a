// finish_all(steps): every step run to its end, in order, whatever interrupts them, for the writes
// that must not stop part-way (loads, the undo of a failed update, swapped()'s swap-out). In C so
// that no Python code runs between the steps, where a signal handler could raise past them.
#include <Python.h>

namespace fused_ema {
namespace {

// The error being raised, taken (the 3.12 API where there is one).
PyObject* take_error() {
#if PY_VERSION_HEX >= 0x030C0000
  return PyErr_GetRaisedException();
#else
  PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  PyErr_NormalizeException(&type, &value, &traceback);
  if (traceback != nullptr && value != nullptr) {
    PyException_SetTraceback(value, traceback);
  }
  Py_XDECREF(type);
  Py_XDECREF(traceback);
  return value;
#endif
}

void raise_error(PyObject* error) {
#if PY_VERSION_HEX >= 0x030C0000
  PyErr_SetRaisedException(error);
#else
  PyErr_Restore(Py_NewRef(reinterpret_cast<PyObject*>(Py_TYPE(error))), error,
                PyException_GetTraceback(error));
#endif
}

}  // namespace

// Runs of a step that an interrupt stops before the next step runs: a signal lands in a step
// once (more if pressed again), while one the step raises itself every time must not loop forever.
constexpr int kMaxInterrupted = 16;

// A step interrupted (KeyboardInterrupt, SystemExit: not an Exception) runs again, up to
// kMaxInterrupted times; one that fails runs once more; then the next one runs. Steps must be
// idempotent. The first error is raised once every step has run.
PyObject* python_finish_all(PyObject* /*module*/, PyObject* steps) {
  PyObject* seq = PySequence_Fast(steps, "finish_all(steps) takes a sequence of callables");
  if (seq == nullptr) {
    return nullptr;
  }
  PyObject* first = nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    // Held while it runs: a step may change the list it came from (the list's item is borrowed).
    PyObject* step = Py_NewRef(PySequence_Fast_GET_ITEM(seq, i));
    for (int failures = 0, interrupts = 0; failures < 2 && interrupts < kMaxInterrupted;) {
      PyObject* result = PyObject_CallNoArgs(step);
      if (result != nullptr) {
        Py_DECREF(result);
        break;
      }
      ++(PyErr_ExceptionMatches(PyExc_Exception) ? failures : interrupts);
      PyObject* error = take_error();
      if (first == nullptr) {
        first = error;
      } else {
        Py_XDECREF(error);
      }
    }
    Py_DECREF(step);
  }
  Py_DECREF(seq);
  if (first != nullptr) {
    raise_error(first);
    return nullptr;
  }
  Py_RETURN_NONE;
}

}  // namespace fused_ema
