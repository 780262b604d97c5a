// The driver of the fused-op family (see fused_op.h): the checks of the weights, the rounding
// arguments and the lists with each op's own messages, the planning of the K * N pairs, and one
// runner call per device. The dispatcher's kernels are in fused_op_kernels.cpp.
#include "fused_op.h"

#include <c10/util/Exception.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <iterator>
#include <utility>

#include "grad_mode.h"
#include "join.h"
#include "opmath.h"

namespace fused_ema {
namespace {

constexpr auto kNumDeviceTypes =
    static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES);

// Keys are 32 bits of a stream's key (stochastic_round.h).
constexpr int64_t kMaxKey = UINT32_MAX;

constexpr const char* kBemaWeights[] = {"beta", "w0", "alpha"};

// Per kind: the Python function that starts its messages (lerp_many_ takes both of its ops), and
// the profiler's name of a run.
struct KindText {
  const char* op;
  const char* record;
};
constexpr KindText kTexts[] = {
    {"fused_ema.lerp_: ", "fused_ema::lerp_"},
    {"fused_ema.lerp_stochastic_: ", "fused_ema::lerp_stochastic_"},
    {"fused_ema.lerp_many_: ", "fused_ema::lerp_many_"},
    {"fused_ema.lerp_many_: ", "fused_ema::lerp_many_stochastic_"},
    {"fused_ema.bema_: ", "fused_ema::bema_"},
};

// A profiler range while this lives (a prepared update's runs skip the dispatcher, which would
// name one), through torch's stable C shim; without a profiler it costs an allocation.
class ProfilerRange {
 public:
  explicit ProfilerRange(const char* name) {
    if (aoti_record_function_start(name, nullptr, nullptr, 0, &guard_) != AOTI_TORCH_SUCCESS) {
      guard_ = nullptr;
    }
  }
  ~ProfilerRange() {
    if (guard_ != nullptr) {
      aoti_record_function_end(guard_);
    }
  }
  ProfilerRange(const ProfilerRange&) = delete;
  ProfilerRange& operator=(const ProfilerRange&) = delete;

 private:
  AtenRecordFunctionHandle guard_ = nullptr;
};

const KindText& text(FusedKind kind) { return kTexts[static_cast<size_t>(kind)]; }

// lerp_ and lerp_stochastic_ take one list (ema[i], a "weight"); the others several.
bool one_list(FusedKind kind) {
  return kind == FusedKind::kLerp || kind == FusedKind::kLerpStochastic;
}

std::array<FusedRunner, kNumDeviceTypes>& runners() {
  static std::array<FusedRunner, kNumDeviceTypes> table{};
  return table;
}

// A weight in messages: lerp_'s "weight", lerp_many_'s "weights[k]", bema_'s "weights[k] (beta)".
std::string weight_name(FusedKind kind, size_t k) {
  if (one_list(kind)) {
    return "weight";
  }
  const std::string name = "weights[" + std::to_string(k) + "]";
  return kind == FusedKind::kBema ? name + " (" + kBemaWeights[k] + ")" : name;
}

// A weight known on the host: finite, and within float32's range.
FusedWeights host_weights(FusedKind kind, std::vector<double> values) {
  for (size_t k = 0; k < values.size(); ++k) {
    TORCH_CHECK_VALUE(std::isfinite(values[k]), text(kind).op, weight_name(kind, k),
                      " must be finite, got ", values[k]);
    TORCH_CHECK_VALUE(fits_float(values[k]), text(kind).op, weight_name(kind, k),
                      " must fit a float32, got ", values[k]);
  }
  FusedWeights weights;
  weights.tracks = values.size();
  weights.values = std::move(values);
  return weights;
}

// A weight or step tensor must be on the plan's device, or read on the host.
void check_on_device(const at::Tensor* t, const char* name, const char* as, FusedKind kind,
                     c10::Device device) {
  const bool one = one_list(kind);
  TORCH_CHECK(t == nullptr || t->is_cpu() || t->device() == device, text(kind).op, name, " is on ",
              t->device(), " but ", one ? "ema" : "EMA", " tensors are on ", device, "; pass the ",
              name, " on the ", one ? "EMA's" : "EMAs'", " device, on the CPU, or as ", as);
}

// The weights' and step's device against the EMA tensors' `device`.
void check_weights_device(const FusedCall& call, c10::Device device) {
  const bool one = one_list(call.kind);
  check_on_device(call.weights.device_tensor, one ? "weight" : "weights",
                  one ? "a float" : "floats", call.kind, device);
  check_on_device(call.rounding.step_tensor, "step", "an int", call.kind, device);
}

// How a call's errors name its pairs.
PairNames pair_names(const FusedCall& call, size_t tensors) {
  return {text(call.kind).op, one_list(call.kind) ? 0 : tensors,
          call.bema() ? kBemaLists : nullptr};
}

// Seeds, keys and offsets against the lists; each tensor's offset leaves room for its elements.
void check_rounding(const FusedCall& call, TensorRefs emas, TensorRefs src) {
  const FusedRounding& r = call.rounding;
  const char* op = text(call.kind).op;
  const bool one = one_list(call.kind);
  const size_t tensors = src.size();
  const size_t tracks = call.weights.tracks;
  TORCH_CHECK_VALUE(r.seeds.size() == tracks, op, "seeds has ", r.seeds.size(),
                    " entries but there are ", tracks, " tracks (one seed per track)");
  TORCH_CHECK_VALUE(
      r.keys.size() == emas.size(), op, "keys has ", r.keys.size(), " entries but ",
      one ? "ema" : "emas", " has ", emas.size(),
      one ? " tensors"
          : " tensors (one key per EMA tensor, track k's tensor i at k * len(src) + i)");
  TORCH_CHECK_VALUE(r.offsets.size() == tensors, op, "offsets has ", r.offsets.size(),
                    " entries but ", one ? "ema" : "src", " has ", tensors, " tensors");
  for (size_t j = 0; j < r.keys.size(); ++j) {
    // keys[i] of lerp_stochastic_, keys[k][i] of lerp_many_stochastic_
    TORCH_CHECK_VALUE(r.keys[j] >= 0 && r.keys[j] <= kMaxKey, op, "keys",
                      one ? "" : "[" + std::to_string(j / tensors) + "]", "[",
                      one ? j : j % tensors, "] is ", r.keys[j],
                      "; keys are 32-bit: 0 <= key <= ", kMaxKey);
  }
  // lerp_stochastic_ names each tensor by its ema, lerp_many_stochastic_ by its (shared) src.
  const TensorRefs named = one ? emas : src;
  const char* name = one ? "ema" : "src";
  for (size_t i = 0; i < tensors; ++i) {
    TORCH_CHECK_VALUE(named[i]->defined(), text(call.kind).op, name, "[", i,
                      "] is an undefined tensor");
    TORCH_CHECK_VALUE(r.offsets[i] >= 0, op, "offsets[", i, "] is ", r.offsets[i],
                      "; an offset is the index of the tensor's first element, >= 0");
    TORCH_CHECK_VALUE(r.offsets[i] <= INT64_MAX - named[i]->numel(), op, "offsets[", i, "] + ",
                      name, "[", i, "].numel() overflows int64");
  }
}

// The lists' lengths against the weights; bema_'s three targets of a tensor share its dtype. The
// planner checks the rest of each (target, src) pair.
void check_lists(const FusedCall& call, TensorRefs emas, TensorRefs src) {
  TORCH_INTERNAL_ASSERT(call.tensors == src.size());
  const char* op = text(call.kind).op;
  const size_t tensors = src.size();
  const size_t tracks = call.weights.tracks;
  if (one_list(call.kind)) {
    TORCH_CHECK_VALUE(emas.size() == tensors, op, "ema has ", emas.size(), " tensors but src has ",
                      tensors);
  } else {
    TORCH_CHECK_VALUE(emas.size() == tracks * tensors, op, "emas has ", emas.size(),
                      " tensors but ", tracks, " weights of ", tensors, " src tensors need ",
                      tracks * tensors, " (track k's tensor i at k * len(src) + i)");
  }
  for (size_t i = 0; call.bema() && i < tensors; ++i) {
    for (size_t k = 0; k < tracks; ++k) {
      TORCH_CHECK_VALUE(emas[k * tensors + i]->defined(), op, kBemaLists[k], "[", i,
                        "] is an undefined tensor");
    }
    const auto type = emas[i]->scalar_type();
    for (size_t k = 1; k < tracks; ++k) {
      const auto other = emas[k * tensors + i]->scalar_type();
      TORCH_CHECK_VALUE(other == type, op, kBemaLists[k], "[", i, "] is ", dtype_name(other),
                        " but ema[", i, "] is ", dtype_name(type),
                        "; ema, theta0 and out share the EMA dtype");
    }
  }
  if (call.stochastic()) {
    check_rounding(call, emas, src);
  }
}

// Groups a plain call's pairs by tensor (the planner added them track by track), each tensor's in
// the order they had.
void group_by_tensor(DevicePlan& plan, size_t tensors, size_t tracks) {
  std::vector<FlatPair>& pairs = plan.pairs;
  if (tracks < 2 || pairs.size() < 2) {
    return;
  }
  const TrackIndex at(tensors);
  Scratch<uint32_t, 0> starts_scratch;
  std::vector<uint32_t>& starts = starts_scratch.vec;
  starts.assign(tensors + 1, 0);
  for (const FlatPair& pair : pairs) {
    ++starts[at.tensor(pair.index) + 1];
  }
  for (size_t i = 0; i < tensors; ++i) {
    starts[i + 1] += starts[i];
  }
  Scratch<FlatPair, 0> grouped;
  grouped.vec.resize(pairs.size());
  for (const FlatPair& pair : pairs) {
    grouped.vec[starts[at.tensor(pair.index)]++] = pair;
  }
  pairs.swap(grouped.vec);
}

}  // namespace

bool register_fused_runner(c10::DeviceType type, FusedRunner runner) {
  runners()[static_cast<size_t>(type)] = runner;
  return true;
}

std::vector<std::string> devices_with_kernels() {
  std::vector<std::string> names;
  for (size_t t = 0; t < kNumDeviceTypes; ++t) {
    if (runners()[t] != nullptr) {
      names.push_back(c10::DeviceTypeName(static_cast<c10::DeviceType>(t), /*lower_case=*/true));
    }
  }
  return names;
}

// A CPU tensor's weights are read here (a few numbers need no trip through the dispatcher); a
// device's are left to its kernel.
FusedWeights checked_weights(FusedKind kind, const at::Tensor& weights, bool read) {
  const char* op = text(kind).op;
  const bool one = one_list(kind);
  const char* name = one ? "weight" : "weights";
  TORCH_CHECK_VALUE(weights.defined(), op, name, " is an undefined tensor");
  if (one) {
    TORCH_CHECK_VALUE(weights.numel() == 1 && weights.dim() <= 1, op,
                      "a tensor weight must hold one element (0-dim or 1-D), got shape ",
                      weights.sizes());
  } else {
    const bool bema = kind == FusedKind::kBema;
    TORCH_CHECK_VALUE(weights.dim() == 1 && (bema ? weights.numel() == 3 : weights.numel() >= 1),
                      op, "weights must be a 1-D tensor of ",
                      bema ? "3 elements (beta, w0, alpha)" : "one weight per track (at least one)",
                      ", got shape ", weights.sizes());
  }
  const auto type = weights.scalar_type();
  TORCH_CHECK_VALUE(type == at::kFloat || type == at::kDouble, op,
                    one ? "a tensor weight" : "weights", " must be float32 or float64, got ",
                    dtype_name(type));
  TORCH_CHECK(!(weights.requires_grad() && grad_mode_enabled()), op, name,
              " requires grad; the EMA update is not differentiable");
  check_storage(weights, op, name);  // read here or by the kernel: freed memory would crash
  const auto tracks = static_cast<size_t>(weights.numel());
  const int64_t stride = weights.dim() == 0 ? 0 : weights.stride(0);
  if (!weights.is_cpu() || !read) {
    FusedWeights checked;
    checked.tracks = tracks;
    checked.device_tensor = &weights;
    checked.stride = stride;
    return checked;
  }
  std::vector<double> values(tracks);
  for (size_t k = 0; k < tracks; ++k) {
    const auto j = static_cast<int64_t>(k) * stride;
    values[k] = type == at::kFloat ? static_cast<double>(weights.const_data_ptr<float>()[j])
                                   : weights.const_data_ptr<double>()[j];
  }
  return host_weights(kind, std::move(values));
}

// lerp_'s Python number: a float or an int (not a bool). The schema's Scalar keeps the Python
// type, so that True is refused here as it is by fused_ema.lerp_.
FusedWeights checked_scalar_weight(const c10::Scalar& weight) {
  TORCH_CHECK_TYPE(weight.isFloatingPoint() || weight.isIntegral(/*includeBool=*/false),
                   text(FusedKind::kLerp).op, "weight must be a float or a 0-dim tensor, got ",
                   weight.isBoolean() ? "bool" : "complex");
  if (weight.isSymbolic()) {  // traced (a fake kernel): checked when the op runs
    FusedWeights traced;
    traced.tracks = 1;
    return traced;
  }
  return host_weights(FusedKind::kLerp, {weight.toDouble()});
}

// A stochastic call: its weights, then its step, one int64 element (read here from the CPU when
// `read`, else left to the kernel), seeds, keys and offsets.
FusedCall stochastic_call(FusedKind kind, size_t tensors, const at::Tensor& weights,
                          const at::Tensor& step, c10::HeaderOnlyArrayRef<int64_t> seeds,
                          c10::HeaderOnlyArrayRef<int64_t> keys,
                          c10::HeaderOnlyArrayRef<int64_t> offsets, bool read) {
  FusedCall call{kind, tensors, checked_weights(kind, weights, read)};
  const char* op = text(kind).op;
  TORCH_CHECK_VALUE(step.defined(), op, "step is an undefined tensor");
  TORCH_CHECK_VALUE(step.numel() == 1 && step.dim() <= 1 && step.scalar_type() == at::kLong, op,
                    "step must be one int64 element (0-dim or 1-D), got ",
                    dtype_name(step.scalar_type()), " of shape ", step.sizes());
  check_storage(step, op, "step");
  const bool on_host = step.is_cpu() && read;
  call.rounding = {seeds, on_host ? static_cast<uint64_t>(*step.const_data_ptr<int64_t>()) : 0,
                   on_host ? nullptr : &step, keys, offsets};
  return call;
}

std::vector<DevicePlan> plan_fused_call(const FusedCall& call, TensorRefs emas, TensorRefs src) {
  check_lists(call, emas, src);
  // Row-major spans where elements are numbered (stochastic rounding), or where the three targets
  // of a tensor must list its elements in one order (bema_). Each finished plan needs a kernel for
  // its device, and the weights and step on that device or the CPU.
  const auto check_device = [&](const DevicePlan& plan) {
    TORCH_CHECK(runners()[static_cast<size_t>(plan.device.type())] != nullptr, text(call.kind).op,
                "no kernel for tensors on ", plan.device,
                " in this build of fused_ema (kernels for: ", join(devices_with_kernels()), ")");
    check_weights_device(call, plan.device);
  };
  std::vector<DevicePlan> plans = plan_pairs(emas, src, call.stochastic() || call.bema(),
                                             check_device, pair_names(call, src.size()));
  for (DevicePlan& plan : plans) {
    if (!call.bema()) {
      group_by_tensor(plan, src.size(), call.weights.tracks);
    }
  }
  return plans;
}

void check_fused_call(const FusedCall& call, TensorRefs emas, TensorRefs src) {
  check_lists(call, emas, src);
  const PairNames names = pair_names(call, src.size());
  std::vector<c10::Device> devices;
  for (size_t j = 0; j < emas.size(); ++j) {  // in plan_pairs's order
    check_pair(*emas[j], *src[j % src.size()], static_cast<int64_t>(j), names);
    if (std::find(devices.begin(), devices.end(), emas[j]->device()) == devices.end()) {
      devices.push_back(emas[j]->device());
    }
  }
  for (const c10::Device& device : devices) {
    check_weights_device(call, device);
  }
}

void run_fused_call(const FusedCall& call, const std::vector<DevicePlan>& plans) {
  const ProfilerRange range(text(call.kind).record);
  const std::vector<double>& values = call.weights.values;
  const bool some_zero = std::find(values.begin(), values.end(), 0.0) != values.end();
  if (call.bema() && some_zero &&
      std::all_of(values.begin(), values.end(), [](double w) { return w == 0.0; })) {
    return;  // host weights all 0: every list stays as it is, untouched
  }
  const TrackIndex at(call.tensors);
  for (const DevicePlan& whole : plans) {
    whole.refill();
    const FusedRunner runner = runners()[static_cast<size_t>(whole.device.type())];
    if (!some_zero || call.bema()) {  // bema_'s kernels leave the lists of a zero weight alone
      runner(whole, call);
      continue;
    }
    // Without the pairs of tracks whose host weight is 0: they would leave every value as it is,
    // so no memory of theirs is touched (nor for NaN or infinite sources).
    DevicePlan kept(whole.device);
    std::copy_if(whole.pairs.begin(), whole.pairs.end(), std::back_inserter(kept.pairs),
                 [&](const FlatPair& p) { return values[at.track(p.index)] != 0.0; });
    kept.write_backs = whole.write_backs;  // a stand-in left alone holds what its EMA held
    runner(kept, call);
  }
}

// The planner's pairs (track k's tensor i at k * tensors + i, in row-major order: stand-ins where
// a layout differs) as one item per source tensor. Every pair of a tensor lists its elements in
// the same order and its src holds the same values, so any of them serves as the item's src.
std::vector<BemaItem> bema_items(const DevicePlan& plan, size_t tensors) {
  std::vector<BemaItem> items(tensors, BemaItem{nullptr, nullptr, nullptr, nullptr, 0, {}});
  const TrackIndex at(tensors);
  for (const FlatPair& pair : plan.pairs) {
    const uint32_t list = at.track(pair.index);
    BemaItem& item = items[at.tensor(pair.index)];
    (list == 0 ? item.ema : list == 1 ? item.theta0 : item.out) = pair.ema;
    item.src = pair.src;
    item.numel = pair.numel;
    item.kind = pair.kind;
  }
  size_t kept = 0;
  for (const BemaItem& item : items) {
    if (item.numel > 0) {
      TORCH_INTERNAL_ASSERT(item.ema != nullptr && item.theta0 != nullptr && item.out != nullptr);
      items[kept++] = item;
    }
  }
  items.resize(kept);
  return items;
}

}  // namespace fused_ema
