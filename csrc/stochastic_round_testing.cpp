// Test-only entry points to stochastic_round.h, so that tests can compare its Philox stream and
// rounding bit for bit with a Python reference: fused_ema._C._philox and _stochastic_round.
#include <ATen/ATen.h>
#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>

#include "stochastic_round.h"

namespace fused_ema {
namespace {

// The low 64 bits of a Python int, negative ones in two's complement.
bool u64_arg(PyObject* obj, uint64_t& out) {
  out = PyLong_AsUnsignedLongLongMask(obj);
  return !(out == static_cast<uint64_t>(-1) && PyErr_Occurred());
}

}  // namespace

// _philox((c0, c1, c2, c3), (k0, k1)) -> (w0, w1, w2, w3)
PyObject* python_philox(PyObject* /*module*/, PyObject* args) {
  sr::Words ctr{};
  uint32_t k0 = 0;
  uint32_t k1 = 0;
  if (!PyArg_ParseTuple(args, "(IIII)(II)", &ctr.w[0], &ctr.w[1], &ctr.w[2], &ctr.w[3], &k0, &k1)) {
    return nullptr;
  }
  const sr::Words out = sr::philox4x32_10(ctr, k0, k1);
  return Py_BuildValue("(kkkk)", static_cast<unsigned long>(out.w[0]),
                       static_cast<unsigned long>(out.w[1]), static_cast<unsigned long>(out.w[2]),
                       static_cast<unsigned long>(out.w[3]));
}

// _stochastic_round(values: float32 CPU tensor, "bfloat16" | "float16", seed, step, key, offset)
// -> tensor: element i rounded with the word of element offset + i.
PyObject* python_stochastic_round(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* values_obj = nullptr;
  const char* dtype = nullptr;
  PyObject* seed_obj = nullptr;
  PyObject* step_obj = nullptr;
  unsigned int key = 0;
  unsigned long long offset = 0;
  if (!PyArg_ParseTuple(args, "OsOOIK", &values_obj, &dtype, &seed_obj, &step_obj, &key, &offset)) {
    return nullptr;
  }
  uint64_t seed = 0;
  uint64_t step = 0;
  if (!u64_arg(seed_obj, seed) || !u64_arg(step_obj, step)) {
    return nullptr;
  }
  TORCH_CHECK_TYPE(THPVariable_Check(values_obj), "values must be a tensor");
  const at::Tensor values = THPVariable_Unpack(values_obj).contiguous();
  TORCH_CHECK_VALUE(values.scalar_type() == at::kFloat && values.is_cpu(),
                    "values must be a float32 CPU tensor");
  const bool bf16 = std::strcmp(dtype, "bfloat16") == 0;
  TORCH_CHECK_VALUE(bf16 || std::strcmp(dtype, "float16") == 0,
                    "dtype must be 'bfloat16' or 'float16', got ", dtype);
  at::Tensor out =
      at::empty(values.sizes(), values.options().dtype(bf16 ? at::kBFloat16 : at::kHalf));
  const float* in = values.const_data_ptr<float>();
  auto* bits = static_cast<uint16_t*>(out.mutable_data_ptr());
  for (int64_t i = 0; i < values.numel(); ++i) {
    uint32_t x = 0;
    std::memcpy(&x, in + i, sizeof(x));
    const uint32_t word = sr::element_word(seed, step, key, offset + static_cast<uint64_t>(i));
    bits[i] = bf16 ? sr::round_bf16(x, word) : sr::round_f16(x, word);
  }
  return THPVariable_Wrap(out);
  END_HANDLE_TH_ERRORS
}

}  // namespace fused_ema
