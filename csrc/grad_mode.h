// Autograd's thread-local on/off switch, read and set through torch's stable C shim
// (aoti_torch_grad_mode_*) rather than c10::GradMode, so that this part needs nothing when the
// extension moves onto the stable ABI.
#pragma once

#include <torch/csrc/stable/c/shim.h>

namespace fused_ema {

inline bool grad_mode_enabled() { return aoti_torch_grad_mode_is_enabled(); }

// Turns autograd off for its lifetime; the destructor puts the caller's mode back on every way out.
class NoGradScope {
 public:
  NoGradScope() : was_enabled_(aoti_torch_grad_mode_is_enabled()) {
    aoti_torch_grad_mode_set_enabled(false);
  }
  ~NoGradScope() { aoti_torch_grad_mode_set_enabled(was_enabled_); }
  NoGradScope(const NoGradScope&) = delete;
  NoGradScope& operator=(const NoGradScope&) = delete;

 private:
  bool was_enabled_;
};

}  // namespace fused_ema
