// Checks the arguments of fused_ema::lerp_ against the op contract and flattens them, per device,
// into dense spans for the kernels. Every check runs before anything is written, so a rejected
// call leaves the EMA tensors as they were.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "dtype_pairs.h"
#include "prefetch.h"

namespace fused_ema {

// Borrowed tensors: a call's lists, or a prepared update's, without touching reference counts.
using TensorRefs = c10::HeaderOnlyArrayRef<const at::Tensor*>;

// A list's tensors as TensorRefs, valid while the list lives.
inline std::vector<const at::Tensor*> refs_of(at::TensorList tensors) {
  std::vector<const at::Tensor*> out(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    out[i] = &tensors[i];
  }
  return out;
}

// One (ema, src) pair as a kernel sees it: dense memory with the same layout on both sides.
struct FlatPair {
  void* ema;
  const void* src;
  int64_t numel;
  PairKind kind;
  uint32_t index;  // in the caller's lists (lerp_stochastic_'s keys and offsets)
};
static_assert(sizeof(FlatPair) == 32, "the index fits in the padding");

// The pairs that live on one device. Stand-ins replace non-contiguous tensors and live as long
// as the plan; write_backs copy results computed in a stand-in into the caller's ema tensor.
struct DevicePlan {
  explicit DevicePlan(c10::Device d) : device(d) {}
  DevicePlan(DevicePlan&&) = default;
  DevicePlan& operator=(DevicePlan&&) = default;
  ~DevicePlan();  // hands `pairs` back to plan_pairs's per-thread pool

  c10::Device device;
  std::vector<FlatPair> pairs;
  std::vector<at::Tensor> stand_ins;
  // (stand-in, src): a src laid out as its ema, copied when the plan runs, not when it is made: a
  // prepared update plans before it copies its staged sources into place.
  std::vector<std::pair<at::Tensor, at::Tensor>> refills;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_backs;

  // Call before the kernels of this plan are issued.
  void refill() const;
  // Call after the kernels of this plan have been issued (stream order covers CUDA).
  void write_back() const;
};

// Lists shorter than this are still in the L2 cache from their last update, where prefetching
// by hand only adds instructions (1,000 tensors cost 20% more with it).
constexpr size_t kPrefetchFrom = 2048;

// A vector lent by a per-thread pool, given back emptied (capacity kept) when this goes, so that
// the buffers of a long list are neither allocated nor faulted in at every call. kPool tells
// pools of one element type apart; a nested call finds its pool lent out and allocates.
template <typename T, int kPool>
class Scratch {
 public:
  Scratch() {
    vec.swap(pool());
    vec.clear();
  }
  ~Scratch() {
    vec.clear();
    if (vec.capacity() > pool().capacity()) {
      pool().swap(vec);
    }
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  std::vector<T> vec;

 private:
  static std::vector<T>& pool() {
    thread_local std::vector<T> lent;
    return lent;
  }
};

// A check of a finished plan that may still refuse the call (throws). Made once per call and run
// once per device, never per tensor; a lambda that captures a reference or two is stored in place.
using PlanCheck = std::function<void(const DevicePlan&)>;

// How errors name a pair's tensors: lerp_'s ema[i] and src[i], or, for lerp_many_'s pairs (track
// k's tensor i at index k * tensors + i), emas[k][i] and src[i]; with track_names (bema_'s lists),
// track_names[k][i].
struct PairNames {
  const char* op = "fused_ema.lerp_: ";
  size_t tensors = 0;                        // 0: lerp_'s lists
  const char* const* track_names = nullptr;  // one name per track, or emas[k]
};

// Refuses `t` (named `name` after `op`) unless its storage holds every element it addresses: one
// freed (untyped_storage().resize_(0), as FSDP frees unsharded parameters) would be read and
// written out of bounds, as torch's own ops do.
void check_storage(const at::Tensor& t, const char* op, const std::string& name);

// The checks of one (ema, src) pair, pair `i` as `names` names it: defined, one device, strided,
// a supported dtype pair, one shape, storage for every element, no internal overlap, no autograd.
// Metadata only.
void check_pair(const at::Tensor& e, const at::Tensor& s, int64_t i, const PairNames& names);

// Checks the (ema, src) pairs of a call and flattens them into per-device plans, one per device in
// order of appearance: `emas` holds the tracks one after another (track k's tensor i at
// k * src.size() + i), each as long as src; `names` says how errors name them. Then checks memory
// overlap and calls `check` on each plan (the caller's checks that need the devices: a kernel for
// it, the weights' device). Only once every check has passed are stand-ins made (row_major: every
// span lists its ema's elements in row-major order, as stochastic rounding numbers them, so a
// non-contiguous ema is computed in a contiguous stand-in and written back) and the EMAs' version
// counters bumped. The tensors must outlive the plans.
std::vector<DevicePlan> plan_pairs(TensorRefs emas, TensorRefs src, bool row_major,
                                   const PlanCheck& check, PairNames names);

}  // namespace fused_ema
