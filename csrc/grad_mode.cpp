// without_grad(fn, *args): fn(*args) with autograd off. The caller's grad mode is put back by a
// destructor on every way out of fn, an exception or an interrupt included, and no Python code
// runs between switching the mode and calling fn, or between fn's return and the switch back.
#include <Python.h>

#include "grad_mode.h"

namespace fused_ema {

PyObject* python_without_grad(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "without_grad(fn, *args) needs fn");
    return nullptr;
  }
  const NoGradScope no_grad;
  return PyObject_Vectorcall(args[0], args + 1, static_cast<size_t>(nargs - 1), nullptr);
}

}  // namespace fused_ema
