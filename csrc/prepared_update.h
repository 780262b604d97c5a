// A ModelEma update prepared once (fused_ema/_update/prepared.py): the tensors it reads and writes
// held here, its fused calls planned once, and each later run one call that checks that every
// tensor still is what was planned, moves the schedules and runs every write. It refuses before
// the first write, and no Python runs between the first write and the last.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "fused_op.h"

namespace fused_ema {

inline constexpr const char* kPreparedOp = "fused_ema.prepared_update: ";

// What a run does to the step counters before averaging.
enum class StepMode : int64_t {
  kAdvance = 0,  // update(model): each counter moves on by one
  kSet = 1,      // update(model, step=s): each counter becomes s
  kKeep = 2,     // the counters were set already (a step tensor, Schedule.begin)
};

// One fused call (kind: the op of the same name, ops.py): `emas` holds its tracks one after another
// (bema_: ema, theta0, out). Its weights are a schedule's weight tensor, or `joint` names the
// schedules whose weights fill it in order.
struct PreparedCall {
  FusedKind kind = FusedKind::kLerp;
  std::vector<at::Tensor> emas;
  std::vector<at::Tensor> src;
  at::Tensor weights;
  std::vector<int64_t> joint;
  at::Tensor step;  // the stochastic kinds' step counter
  std::vector<int64_t> seeds, keys, offsets;
  std::vector<DevicePlan> plans;  // kept while every tensor stays as planned
};

// What a tensor was when the calls were planned (data, elements, dtype, device, contiguity, shape).
struct TensorState {
  const void* data = nullptr;
  int64_t numel = -1;
  uint64_t layout = 0;

  bool operator==(const TensorState& o) const {
    return data == o.data && numel == o.numel && layout == o.layout;
  }
};

class PreparedUpdate {
 public:
  // `schedules` holds (step, out, config) of each schedule (Schedule in fused_ema/_update).
  explicit PreparedUpdate(std::vector<at::Tensor> schedules);

  void add_call(PreparedCall call);
  // Copies dst[i] <- src[i] of each run: after the calls, or, `staging`, before them (sources
  // copied next to their EMA: another device, or a dtype the kernels take).
  void add_copies(std::vector<at::Tensor> dst, std::vector<at::Tensor> src, bool staging);

  // One update. False, having changed nothing, when a tensor is no longer what was planned and
  // `replan` is false; with `replan`, plans again (the ops' own checks and errors) and runs.
  bool run(StepMode mode, int64_t step, bool replan);

  // Runs completed: a caller interrupted around run() tells from it whether the update happened.
  int64_t runs() const { return runs_.load(); }

 private:
  bool unchanged() const;
  void plan();
  void advance(StepMode mode, int64_t step);
  void run_call(const PreparedCall& call);

  // Copies of each run: dst[i] <- src[i].
  struct Copies {
    std::vector<at::Tensor> dst, src;
    void run() const;
  };

  std::vector<at::Tensor> schedules_;
  std::vector<PreparedCall> calls_;
  Copies staging_, copies_;                 // before the calls, after them
  std::vector<const at::Tensor*> watched_;  // every tensor of every call and copy
  std::vector<TensorState> states_;         // theirs when planned
  bool reusable_ = false;                   // planned, and the plans may run again
  std::atomic<int64_t> runs_{0};
  std::vector<c10::TensorImpl*> written_;  // the EMA tensors whose version each run moves
};

}  // namespace fused_ema
