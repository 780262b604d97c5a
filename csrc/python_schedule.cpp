// fused_ema._C.schedule_begin(schedule, step): Schedule.begin (fused_ema/_schedule.py) in one call.
// No Python code, hence no interrupt, runs between saving the counter, marking the schedule dirty
// (its rollback() then restores the saved value) and moving the counter; and the ema_schedule_ op
// is called through the dispatcher without torch.ops' Python layer (~1 us of a small update).
#include <ATen/core/dispatch/Dispatcher.h>
#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

namespace fused_ema {
namespace {

// schedule.<name>, which must be a tensor; `name` is an interned str.
at::Tensor tensor_attribute(PyObject* schedule, PyObject* name) {
  PyObject* value = PyObject_GetAttr(schedule, name);
  if (value == nullptr) {
    throw python_error();
  }
  if (!THPVariable_Check(value)) {
    Py_DECREF(value);
    TORCH_CHECK_TYPE(false, "schedule_begin: schedule.", PyUnicode_AsUTF8(name),
                     " is not a tensor");
  }
  at::Tensor tensor = THPVariable_Unpack(value);
  Py_DECREF(value);
  return tensor;
}

PyObject* interned(const char* text) {
  PyObject* name = PyUnicode_InternFromString(text);
  if (name == nullptr) {
    throw python_error();
  }
  return name;  // kept for the life of the process
}

// The counter and its saved copy are one int64 each, made by Schedule; on the CPU a plain store
// replaces copy_/fill_ (a TensorIterator each, most of a small update's schedule cost).
void store(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.is_cpu() && src.is_cpu() && dst.numel() == 1 && src.numel() == 1 &&
      dst.scalar_type() == at::kLong && src.scalar_type() == at::kLong) {
    *dst.mutable_data_ptr<int64_t>() = *src.const_data_ptr<int64_t>();
  } else {
    dst.copy_(src);
  }
}

void run_schedule(const at::Tensor& step, const at::Tensor& out, const at::Tensor& config,
                  bool advance) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fused_ema::ema_schedule_", "")
          .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>();
  op.call(step, out, config, advance);
}

}  // namespace

PyObject* python_schedule_begin(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "schedule_begin(schedule, step) takes 2 arguments (%zd)", nargs);
    return nullptr;
  }
  PyObject* schedule = args[0];
  PyObject* step = args[1];
  static PyObject* const kStep = interned("step");
  static PyObject* const kSaved = interned("_saved");
  static PyObject* const kOut = interned("out");
  static PyObject* const kConfig = interned("config");
  static PyObject* const kDirty = interned("_dirty");
  const at::Tensor counter = tensor_attribute(schedule, kStep);
  const at::Tensor saved = tensor_attribute(schedule, kSaved);
  const at::Tensor out = tensor_attribute(schedule, kOut);
  const at::Tensor config = tensor_attribute(schedule, kConfig);
  int64_t value = 0;
  if (step != Py_None && !THPVariable_Check(step)) {
    value = PyLong_AsLongLong(step);  // an int Schedule.check_step accepted
    if (value == -1 && PyErr_Occurred()) {
      return nullptr;
    }
  }
  store(saved, counter);
  if (PyObject_SetAttr(schedule, kDirty, Py_True) < 0) {
    return nullptr;
  }
  if (step == Py_None) {
    run_schedule(counter, out, config, /*advance=*/true);
    Py_RETURN_NONE;
  }
  if (THPVariable_Check(step)) {
    const at::Tensor& given = THPVariable_Unpack(step);
    if (given.device() == counter.device() || !given.is_cpu()) {
      counter.copy_(given.reshape({}));
    } else {
      counter.fill_(given.item());  // a CPU tensor for a device counter: no device sync
    }
  } else if (counter.is_cpu() && counter.numel() == 1 && counter.scalar_type() == at::kLong) {
    *counter.mutable_data_ptr<int64_t>() = value;
  } else {
    counter.fill_(value);
  }
  run_schedule(counter, out, config, /*advance=*/false);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

}  // namespace fused_ema
