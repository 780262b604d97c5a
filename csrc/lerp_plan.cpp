// Validation and flattening of fused_ema::lerp_ arguments, shared by every device. One pass over
// the tensors touches each one's metadata once (with prefetch: after a large update it has left
// the cache), then one sort of address ranges and a linear sweep find any memory overlap.
#include "lerp_plan.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "grad_mode.h"

namespace fused_ema {
namespace {

// The memory of a tensor, [lo, hi) in bytes, and its index in the caller's lists.
struct Interval {
  uintptr_t lo;
  uintptr_t hi;
  int64_t index;

  bool operator==(const Interval& o) const { return lo == o.lo && hi == o.hi && index == o.index; }
};

// Metadata of a long list has left the cache by the time it is checked. It is prefetched in
// stages, each a few tensors further ahead than the object its address is read from:
// kAhead * 2: the at::Tensor, * 1: its TensorImpl (whole objects: no assumption on their layout).
constexpr size_t kAhead = 12;

// The tensor at `i` of `list`, prefetched in stages for the walk over it.
[[gnu::always_inline]] inline void prefetch_ahead(TensorRefs list, size_t i) {
  const size_t count = list.size();
  if (i + 2 * kAhead < count) {
    prefetch_object<sizeof(at::Tensor)>(list[i + 2 * kAhead]);
  }
  if (i + kAhead < count) {
    prefetch_object<sizeof(c10::TensorImpl)>(list[i + kAhead]->unsafeGetTensorImpl());
  }
}

// Elements from the lowest to one past the highest; PyTorch strides are never negative.
[[gnu::noinline]] int64_t strided_extent(const at::Tensor& t) {
  int64_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d) {
    extent += (t.size(d) - 1) * t.stride(d);
  }
  return extent;
}

// Inlined: an Interval returned from a call costs a store-forwarding stall per tensor.
[[gnu::always_inline]] inline Interval memory_interval(const at::Tensor& t, const void* data,
                                                       bool contiguous, int64_t index) {
  const int64_t extent = contiguous ? t.numel() : strided_extent(t);
  const auto lo = reinterpret_cast<uintptr_t>(data);
  return {lo, lo + static_cast<uintptr_t>(extent * t.element_size()), index};
}

// Not IntArrayRef's operator==: its memcmp call costs many tiny tensors more than a loop over a
// handful of dimensions.
bool same_shape(c10::IntArrayRef a, c10::IntArrayRef b) {
  if (a.size() != b.size()) {
    return false;
  }
  for (size_t d = 0; d < a.size(); ++d) {
    if (a[d] != b[d]) {
      return false;
    }
  }
  return true;
}

// A pair's tensors in error messages (PairNames): ema[i], emas[k][i] or track_names[k][i].
std::string ema_name(const PairNames& names, int64_t index) {
  const auto tensors = static_cast<int64_t>(names.tensors);
  if (tensors == 0) {
    return "ema[" + std::to_string(index) + "]";
  }
  const std::string track = names.track_names != nullptr
                                ? names.track_names[index / tensors]
                                : "emas[" + std::to_string(index / tensors) + "]";
  return track + "[" + std::to_string(index % tensors) + "]";
}

std::string src_name(const PairNames& names, int64_t index) {
  const auto tensors = static_cast<int64_t>(names.tensors);
  return "src[" + std::to_string(tensors == 0 ? index : index % tensors) + "]";
}

// Whether two pairs share their src tensor (lerp_many_'s tracks share each src).
bool same_src(const PairNames& names, int64_t a, int64_t b) {
  const auto tensors = static_cast<int64_t>(names.tensors);
  return tensors == 0 ? a == b : a % tensors == b % tensors;
}

// A pair whose layouts do not line up: compute through contiguous stand-ins.
void add_stand_in_pair(DevicePlan& plan, const at::Tensor& e, const at::Tensor& s, uint32_t index,
                       bool row_major) {
  const PairKind kind = *pair_kind(e.scalar_type(), s.scalar_type());
  const int64_t n = e.numel();
  if (row_major ? e.is_contiguous() : e.is_non_overlapping_and_dense()) {
    // A permuted but dense ema is updated where it lies; src is laid out to match it.
    at::Tensor matched = at::empty_strided(e.sizes(), e.strides(), s.options());
    plan.pairs.push_back({e.mutable_data_ptr(), matched.const_data_ptr(), n, kind, index});
    plan.refills.emplace_back(matched, s);
    plan.stand_ins.push_back(std::move(matched));
  } else {
    // An ema with gaps (a strided slice): compute in a dense copy, then write it back.
    at::Tensor dense_ema = e.contiguous();
    at::Tensor dense_src = s.is_contiguous() ? s : at::empty(s.sizes(), s.options());
    if (!s.is_contiguous()) {
      plan.refills.emplace_back(dense_src, s);
    }
    plan.pairs.push_back(
        {dense_ema.mutable_data_ptr(), dense_src.const_data_ptr(), n, kind, index});
    plan.write_backs.emplace_back(e, dense_ema);
    plan.stand_ins.push_back(std::move(dense_src));
  }
}

// ema tensors must not share memory with each other, nor with any src (a src read after another
// pair wrote it would make the result depend on thread timing).
void check_overlap(std::vector<Interval>& emas, std::vector<Interval>& srcs,
                   const PairNames& names) {
  const auto by_lo = [](const Interval& a, const Interval& b) { return a.lo < b.lo; };
  for (std::vector<Interval>* ranges : {&emas, &srcs}) {
    if (!std::is_sorted(ranges->begin(), ranges->end(), by_lo)) {
      std::sort(ranges->begin(), ranges->end(), by_lo);
    }
  }
  for (size_t k = 1; k < emas.size(); ++k) {
    const Interval& a = emas[k - 1];
    const Interval& b = emas[k];
    TORCH_CHECK(b.lo >= a.hi, names.op, ema_name(names, std::min(a.index, b.index)), " and ",
                ema_name(names, std::max(a.index, b.index)),
                " share memory (their address ranges overlap); every EMA tensor must own its "
                "memory");
  }
  size_t k = 0;
  for (const Interval& s : srcs) {
    while (k < emas.size() && emas[k].hi <= s.lo) {
      ++k;
    }
    if (k < emas.size() && emas[k].lo < s.hi) {
      const int64_t j = emas[k].index;
      TORCH_CHECK(!same_src(names, j, s.index), names.op, src_name(names, s.index), " aliases ",
                  ema_name(names, j), " (they share memory); src must be a different tensor");
      TORCH_CHECK(false, names.op, src_name(names, s.index), " shares memory with ",
                  ema_name(names, j), "; the update would read values it is writing");
    }
  }
}

// The same lists come back every training step (ModelEma, optimizer-style loops). Checking them
// means sorting their address ranges; a thread remembers the last ranges it found free of overlap
// and skips the sort when the new ones are identical, compared exactly.
void check_overlap_once(std::vector<Interval>& emas, std::vector<Interval>& srcs,
                        const PairNames& names) {
  thread_local std::vector<Interval> last_emas;
  thread_local std::vector<Interval> last_srcs;
  if (emas == last_emas && srcs == last_srcs) {
    return;
  }
  last_emas = emas;
  last_srcs = srcs;
  try {
    check_overlap(emas, srcs, names);
  } catch (...) {
    last_emas.clear();
    last_srcs.clear();
    throw;
  }
}

// A dimension of more than one element with stride 0 (an expand()ed view) writes its elements
// to one place: at::has_internal_overlap's "Yes" (its other cases are allowed).
bool has_stride0_dim(const at::Tensor& t) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1 && t.stride(d) == 0) {
      return true;
    }
  }
  return false;
}

std::vector<FlatPair>& spare_pairs() {
  thread_local std::vector<FlatPair> pool;
  return pool;
}

// plan_pairs's state: the pairs checked so far, per device. Pairs are added track by track, each
// list walked in order (planning 20,000 small tensors in 4 tracks took 15% longer tensor by
// tensor, with five lists walked side by side).
class Planner {
 public:
  Planner(size_t count, bool row_major, const PairNames& names)
      : count_(count), row_major_(row_major), names_(names) {
    TORCH_CHECK_VALUE(count <= UINT32_MAX, names.op, "at most ", UINT32_MAX,
                      names.tensors == 0 ? " tensors" : " (ema, src) pairs", " per call, got ",
                      count);
    bumped_.vec.resize(count);
  }
  Planner(const Planner&) = delete;
  Planner& operator=(const Planner&) = delete;
  ~Planner() {
    if (!work_.empty()) {
      work_[0].ema_ranges.swap(first_ema_ranges_.vec);
      work_[0].src_ranges.swap(first_src_ranges_.vec);
    }
  }

  // Checks pair `i` (< count, each once; plans keep the order of adds): nothing is written yet.
  void add(const at::Tensor& e, const at::Tensor& s, size_t i) {
    const auto index = static_cast<int64_t>(i);
    check_pair(e, s, index, names_);
    bumped_.vec[i] = e.unsafeGetTensorImpl();
    DeviceWork& w = work_for(e.device());
    const int64_t n = e.numel();
    if (n == 0) {
      return;
    }
    const bool e_contiguous = e.is_contiguous();
    const bool s_contiguous = s.is_contiguous();
    void* e_data = e.mutable_data_ptr();
    const void* s_data = s.const_data_ptr();
    w.ema_ranges.push_back(memory_interval(e, e_data, e_contiguous, index));
    if (names_.tensors == 0 || i < names_.tensors) {
      // lerp_many_'s tracks share each src (and its device): its range once, with track 0's pair.
      w.src_ranges.push_back(memory_interval(s, s_data, s_contiguous, index));
    }
    // Dense memory with the same layout on both sides (in row-major order where it must be).
    const bool dense = (e_contiguous && s_contiguous) ||
                       (e.is_non_overlapping_and_dense() && s.strides() == e.strides());
    if (dense && (e_contiguous || !row_major_)) {
      // Written in place (sized for every pair up front): push_back is an out-of-line call.
      FlatPair& pair = w.plan.pairs[w.pair_count++];
      pair.ema = e_data;
      pair.src = s_data;
      pair.numel = n;
      pair.kind = *pair_kind(e.scalar_type(), s.scalar_type());
      pair.index = static_cast<uint32_t>(i);
    } else {
      w.stand_ins.push_back({&e, &s, static_cast<uint32_t>(i)});
    }
  }

  std::vector<DevicePlan> finish(const PlanCheck& check) {
    for (DeviceWork& w : work_) {
      w.plan.pairs.resize(w.pair_count);
      check_overlap_once(w.ema_ranges, w.src_ranges, names_);
    }
    for (const DeviceWork& w : work_) {
      check(w.plan);
    }
    // Every check has passed: only now may stand-ins be made and versions move.
    std::vector<DevicePlan> plans;
    plans.reserve(work_.size());
    for (DeviceWork& w : work_) {
      for (const StandIn& pair : w.stand_ins) {
        add_stand_in_pair(w.plan, *pair.ema, *pair.src, pair.index, row_major_);
      }
      plans.push_back(std::move(w.plan));
    }
    for (c10::TensorImpl* impl : bumped_.vec) {
      impl->bump_version();  // torch's own bump (an inference tensor outside InferenceMode raises)
    }
    return plans;
  }

 private:
  struct StandIn {
    const at::Tensor* ema;
    const at::Tensor* src;
    uint32_t index;
  };
  // Per device: the plan under construction, the address ranges, and the pairs left for
  // stand-ins.
  struct DeviceWork {
    explicit DeviceWork(c10::Device d) : plan(d) {}
    DevicePlan plan;
    std::vector<Interval> ema_ranges;
    std::vector<Interval> src_ranges;
    std::vector<StandIn> stand_ins;
    size_t pair_count = 0;  // plan.pairs is sized for every pair until finish()
  };

  DeviceWork& work_for(c10::Device device) {
    if (!work_.empty() && work_[current_].plan.device == device) {
      return work_[current_];
    }
    const auto found = std::find_if(work_.begin(), work_.end(),
                                    [&](const DeviceWork& w) { return w.plan.device == device; });
    current_ = static_cast<size_t>(found - work_.begin());
    if (found == work_.end()) {
      DeviceWork& w = work_.emplace_back(device);
      if (work_.size() == 1) {
        w.plan.pairs.swap(spare_pairs());
        w.ema_ranges.swap(first_ema_ranges_.vec);
        w.src_ranges.swap(first_src_ranges_.vec);
      }
      w.plan.pairs.resize(count_);
      w.ema_ranges.reserve(count_);
      w.src_ranges.reserve(count_);
    }
    return work_[current_];
  }

  size_t count_;
  bool row_major_;
  PairNames names_;
  std::vector<DeviceWork> work_;
  size_t current_ = 0;
  // The first device's buffers and the EMAs whose versions move come from per-thread pools.
  Scratch<Interval, 0> first_ema_ranges_;
  Scratch<Interval, 1> first_src_ranges_;
  Scratch<c10::TensorImpl*, 0> bumped_;
};

// How many bytes t addresses beyond the end of its storage (0 when it has none to check).
int64_t missing_bytes(const at::Tensor& t) {
  if (t.numel() == 0 || !t.has_storage()) {
    return 0;
  }
  int64_t last = t.storage_offset();
  for (int64_t d = 0; d < t.dim(); ++d) {
    last += (t.size(d) - 1) * t.stride(d);
  }
  const auto needed = (last + 1) * static_cast<int64_t>(t.itemsize());
  const auto held = static_cast<int64_t>(t.storage().nbytes());
  return needed > held ? needed - held : 0;
}

}  // namespace

void check_storage(const at::Tensor& t, const char* op, const std::string& name) {
  const int64_t missing = missing_bytes(t);
  TORCH_CHECK_VALUE(missing == 0, op, name, "'s storage holds ", t.storage().nbytes(),
                    " bytes but its elements need ", t.storage().nbytes() + missing,
                    " (was it freed, e.g. by untyped_storage().resize_(0)?); give it back its "
                    "memory first");
}

void check_pair(const at::Tensor& e, const at::Tensor& s, int64_t i, const PairNames& names) {
  const char* op = names.op;
  const auto ema = [&] { return ema_name(names, i); };
  const auto src = [&] { return src_name(names, i); };
  TORCH_CHECK(e.defined(), op, ema(), " is an undefined tensor");
  TORCH_CHECK(s.defined(), op, src(), " is an undefined tensor");
  TORCH_CHECK(s.device() == e.device(), op, src(), " is on ", s.device(), " but ", ema(), " is on ",
              e.device(),
              "; each pair must share a device (move src to the EMA's device first, as "
              "fused_ema.ModelEma does)");
  TORCH_CHECK_VALUE(e.layout() == c10::kStrided && s.layout() == c10::kStrided, op, ema(), " and ",
                    src(), " must be dense (strided) tensors, got layouts ", e.layout(), " and ",
                    s.layout());
  const auto et = e.scalar_type();
  const auto st = s.scalar_type();
  TORCH_CHECK_VALUE(at::isFloatingType(et), op, ema(), " has dtype ", dtype_name(et),
                    "; only floating-point tensors can be averaged");
  TORCH_CHECK_VALUE(at::isFloatingType(st), op, src(), " has dtype ", dtype_name(st),
                    "; only floating-point tensors can be averaged");
  TORCH_CHECK_VALUE(pair_kind(et, st).has_value(), op, "unsupported dtype pair at ",
                    names.tensors == 0 ? "index " + std::to_string(i) : ema(), ": ema ",
                    dtype_name(et), ", src ", dtype_name(st),
                    "; supported (ema, src) pairs: ", supported_pairs_text());
  TORCH_CHECK_VALUE(same_shape(e.sizes(), s.sizes()), op, src(), " has shape ", s.sizes(), " but ",
                    ema(), " has shape ", e.sizes());
  if (missing_bytes(e) != 0 || missing_bytes(s) != 0) {  // the names only made when refused
    check_storage(e, op, ema());
    check_storage(s, op, src());
  }
  TORCH_CHECK(e.is_contiguous() || !has_stride0_dim(e), op, ema(),
              " has internally overlapping memory (an expand()ed or stride-0 view) and cannot "
              "be updated in place");
  TORCH_CHECK(!(e.requires_grad() && grad_mode_enabled()), op, ema(),
              " requires grad and grad mode is on; the EMA update is not differentiable, so "
              "call it under torch.no_grad()");
  TORCH_CHECK(!e.is_inference() || c10::InferenceMode::is_enabled(), op, ema(),
              " is an inference tensor, which cannot be updated in place outside "
              "torch.inference_mode(); clone it first");
}

DevicePlan::~DevicePlan() {
  if (pairs.capacity() > spare_pairs().capacity()) {
    pairs.clear();
    spare_pairs().swap(pairs);
  }
}

void DevicePlan::refill() const {
  for (const auto& [stand_in, src] : refills) {
    stand_in.copy_(src);
  }
}

void DevicePlan::write_back() const {
  for (const auto& [target, computed] : write_backs) {
    target.copy_(computed);
  }
}

std::vector<DevicePlan> plan_pairs(TensorRefs emas, TensorRefs src, bool row_major,
                                   const PlanCheck& check, PairNames names) {
  const size_t tensors = src.size();
  const size_t tracks = tensors == 0 ? 0 : emas.size() / tensors;
  TORCH_INTERNAL_ASSERT(tracks * tensors == emas.size());
  Planner planner(emas.size(), row_major, names);
  const bool far = tensors >= kPrefetchFrom;
  for (size_t k = 0; k < tracks; ++k) {
    const TensorRefs track = emas.slice(k * tensors, tensors);
    for (size_t i = 0; i < tensors; ++i) {
      if (far) {
        prefetch_ahead(track, i);
        prefetch_ahead(src, i);
      }
      planner.add(*track[i], *src[i], k * tensors + i);
    }
  }
  return planner.finish(check);
}

}  // namespace fused_ema
