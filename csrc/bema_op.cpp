// The driver behind fused_ema::bema_ (see bema_op.h): the checks of its weights and lists, the
// planning of its 3 * N (target, src) pairs through lerp_'s planner, and one runner call per
// device with the pairs regrouped into one item per source tensor.
#include "bema_op.h"

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <array>
#include <cmath>

#include "lerp_op.h"
#include "opmath.h"
#include "weight_vector.h"

namespace fused_ema {
namespace {

constexpr const char* kOp = "fused_ema.bema_: ";
constexpr int kLists = 3;  // ema, theta0, out: the planner's tracks 0, 1, 2
constexpr const char* kListNames[kLists] = {"ema", "theta0", "out"};
constexpr const char* kWeightNames[kLists] = {"beta", "w0", "alpha"};
constexpr auto kNumDeviceTypes =
    static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES);

std::array<BemaRunner, kNumDeviceTypes>& runners() {
  static std::array<BemaRunner, kNumDeviceTypes> table{};
  return table;
}

// Equal lengths, defined tensors, and ema[i]'s dtype for theta0[i] and out[i]; the planner checks
// the rest of each (target, src) pair.
void check_lists(const std::array<TensorRefs, kLists>& lists, TensorRefs src) {
  for (int k = 0; k < kLists; ++k) {
    TORCH_CHECK_VALUE(lists[k].size() == src.size(), kOp, kListNames[k], " has ", lists[k].size(),
                      " tensors but src has ", src.size());
  }
  for (size_t i = 0; i < src.size(); ++i) {
    for (int k = 0; k < kLists; ++k) {
      TORCH_CHECK_VALUE(lists[k][i]->defined(), kOp, kListNames[k], "[", i,
                        "] is an undefined tensor");
    }
    const auto type = lists[0][i]->scalar_type();
    for (int k = 1; k < kLists; ++k) {
      const auto other = lists[k][i]->scalar_type();
      TORCH_CHECK_VALUE(other == type, kOp, kListNames[k], "[", i, "] is ", dtype_name(other),
                        " but ema[", i, "] is ", dtype_name(type),
                        "; ema, theta0 and out share the EMA dtype");
    }
  }
}

// The planner's pairs (track k's tensor i at k * tensors + i, in row-major order: stand-ins where
// a layout differs) as one item per source tensor. Every pair of a tensor lists its elements in
// the same order and its src holds the same values, so any of them serves as the item's src.
std::vector<BemaItem> items_of(const DevicePlan& plan, size_t tensors) {
  std::vector<BemaItem> items(tensors, BemaItem{nullptr, nullptr, nullptr, nullptr, 0, {}});
  for (const FlatPair& pair : plan.pairs) {
    const size_t list = pair.index / tensors;
    BemaItem& item = items[pair.index % tensors];
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

}  // namespace

bool register_bema_runner(c10::DeviceType type, BemaRunner runner) {
  runners()[static_cast<size_t>(type)] = runner;
  return true;
}

// A CPU tensor's weights are read here; a device's are left to its kernel.
BemaWeights checked_bema_weights(const at::Tensor& weights) {
  const auto values = weight_vector(weights, kLists, kOp, "3 elements (beta, w0, alpha)");
  if (!values) {
    BemaWeights checked;
    checked.device_tensor = &weights;
    return checked;
  }
  return checked_bema_weights({(*values)[0], (*values)[1], (*values)[2]});
}

BemaWeights checked_bema_weights(const double (&values)[3]) {
  BemaWeights checked;
  for (int k = 0; k < kLists; ++k) {
    TORCH_CHECK_VALUE(std::isfinite(values[k]), kOp, "weights[", k, "] (", kWeightNames[k],
                      ") must be finite, got ", values[k]);
    TORCH_CHECK_VALUE(fits_float(values[k]), kOp, "weights[", k, "] (", kWeightNames[k],
                      ") must fit a float32, got ", values[k]);
    checked.values[k] = values[k];
  }
  return checked;
}

void bema(TensorRefs ema, TensorRefs theta0, TensorRefs out, TensorRefs src,
          const at::Tensor& weights) {
  const BemaWeights checked = checked_bema_weights(weights);
  run_bema_call(plan_bema_call(ema, theta0, out, src, checked), src.size(), checked);
}

std::vector<DevicePlan> plan_bema_call(TensorRefs ema, TensorRefs theta0, TensorRefs out,
                                       TensorRefs src, const BemaWeights& weights) {
  const std::array<TensorRefs, kLists> lists{ema, theta0, out};
  check_lists(lists, src);
  std::vector<const at::Tensor*> targets;
  targets.reserve(kLists * src.size());
  for (const TensorRefs list : lists) {
    targets.insert(targets.end(), list.begin(), list.end());
  }
  // Row-major spans: the three targets of a tensor must list its elements in one order.
  return plan_lerp_many(
      targets, src, /*row_major=*/true,
      [&](const DevicePlan& plan) {
        check_has_kernel(runners()[static_cast<size_t>(plan.device.type())] != nullptr, plan.device,
                         kOp);
        const at::Tensor* t = weights.device_tensor;
        TORCH_CHECK(t == nullptr || t->device() == plan.device, kOp, "weights is on ", t->device(),
                    " but EMA tensors are on ", plan.device,
                    "; pass the weights on the EMAs' device, on the CPU, or as floats");
      },
      {kOp, 0, kListNames});
}

void run_bema_call(const std::vector<DevicePlan>& plans, size_t tensors,
                   const BemaWeights& weights) {
  RECORD_FUNCTION("fused_ema::bema_", std::vector<c10::IValue>());
  if (!weights.any_work()) {
    return;  // host weights all 0: every list stays as it is, untouched
  }
  for (const DevicePlan& plan : plans) {
    runners()[static_cast<size_t>(plan.device.type())](plan, items_of(plan, tensors), weights);
  }
}

void bema_op(at::TensorList ema, at::TensorList theta0, at::TensorList out, at::TensorList src,
             const at::Tensor& weights) {
  bema(tensor_refs(ema), tensor_refs(theta0), tensor_refs(out), tensor_refs(src), weights);
}

}  // namespace fused_ema

// As lerp_op.cpp's: empty lists and devices without a fused_ema kernel.
TORCH_LIBRARY_IMPL(fused_ema, CompositeExplicitAutograd, m) {
  m.impl("bema_", &fused_ema::bema_op);
}
