// The prepared update (prepared_update.h): planning goes through the ops' own driver (their checks
// and errors); a run reuses the plans while every tensor keeps its data, size, dtype and device.
// Handles, ops and the Python entry points are in prepared_handles.cpp.
#include "prepared_update.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/stable/ops.h>

#include <cstring>
#include <string>

#include "fused_op.h"
#include "grad_mode.h"
#include "schedule.h"

namespace fused_ema {
namespace {

// Tensors ahead whose TensorImpl, then storage, are prefetched by unchanged(): after an update of
// a large model its metadata has left the cache. Only these hints know the objects' sizes (the
// check reads them through at::Tensor); without them 20,000 x 1,000 updates cost about 0.5 ms more.
constexpr size_t kImplAhead = 16;
constexpr size_t kStorageAhead = 8;
// Tensors from which the check is split between threads (fewer are still in the L2 cache).
constexpr int64_t kParallelCheckFrom = 4096;

// fn(begin, end) over [0, count): split between threads from kParallelCheckFrom on, so that the
// cache misses of a long list overlap.
template <typename Fn>
void over_tensors(size_t count, const Fn& fn) {
  const auto n = static_cast<int64_t>(count);
  if (n < kParallelCheckFrom) {
    fn(0, n);
  } else {
    torch::stable::parallel_for(0, n, kParallelCheckFrom / 2, fn);
  }
}

TensorState state_of(const at::Tensor& t) {
  TensorState state;
  state.numel = t.numel();
  if (t.has_storage() && t.storage().data() != nullptr) {
    state.data = static_cast<const char*>(t.storage().data()) +
                 t.storage_offset() * static_cast<int64_t>(t.itemsize());
  }
  const c10::Device device = t.device();
  uint64_t layout = static_cast<uint64_t>(t.scalar_type()) |
                    static_cast<uint64_t>(device.type()) << 8 |
                    static_cast<uint64_t>(static_cast<uint8_t>(device.index())) << 16 |
                    static_cast<uint64_t>(t.is_contiguous()) << 24;
  for (const int64_t size : t.sizes()) {
    layout = (layout ^ static_cast<uint64_t>(size)) * 0x100000001b3ULL;  // FNV-1a's prime
  }
  state.layout = layout;
  return state;
}

// The call as the driver takes it. Its weights and step are read anew; seeds, keys and offsets
// are checked where the call is planned.
FusedCall fused_call_of(const PreparedCall& call) {
  if (is_stochastic(call.kind)) {
    return stochastic_call(call.kind, call.src.size(), call.weights, call.step, call.seeds,
                           call.keys, call.offsets);
  }
  return {call.kind, call.src.size(), checked_weights(call.kind, call.weights)};
}

}  // namespace

PreparedUpdate::PreparedUpdate(std::vector<at::Tensor> schedules)
    : schedules_(std::move(schedules)) {
  TORCH_CHECK_VALUE(schedules_.size() % 3 == 0, kPreparedOp,
                    "schedules holds (step, out, config) triples, got ", schedules_.size(),
                    " tensors");
  for (size_t s = 0; s < schedules_.size(); s += 3) {
    check_schedule_tensors(schedules_[s], schedules_[s + 1], schedules_[s + 2]);
  }
}

void PreparedUpdate::add_call(PreparedCall call) {
  const size_t n = call.src.size();
  TORCH_CHECK_VALUE(n == 0 ? call.emas.empty() : call.emas.size() % n == 0, kPreparedOp,
                    "emas has ", call.emas.size(), " tensors, not a multiple of the ", n,
                    " sources");
  for (const int64_t s : call.joint) {
    TORCH_CHECK_VALUE(s >= 0 && static_cast<size_t>(s) < schedules_.size() / 3, kPreparedOp,
                      "joint names schedule ", s, " of ", schedules_.size() / 3);
  }
  for (const at::Tensor& t : call.emas) {
    written_.push_back(t.unsafeGetTensorImpl());
  }
  calls_.push_back(std::move(call));
  reusable_ = false;
}

void PreparedUpdate::add_copies(std::vector<at::Tensor> dst, std::vector<at::Tensor> src,
                                bool staging) {
  TORCH_CHECK_VALUE(dst.size() == src.size(), kPreparedOp, "copies: ", dst.size(), " targets but ",
                    src.size(), " sources");
  Copies& copies = staging ? staging_ : copies_;
  for (size_t i = 0; i < dst.size(); ++i) {
    TORCH_CHECK_VALUE(dst[i].defined() && src[i].defined(), kPreparedOp, "copies: tensor ", i,
                      " is undefined");
    copies.dst.push_back(std::move(dst[i]));
    copies.src.push_back(std::move(src[i]));
  }
  reusable_ = false;
}

bool PreparedUpdate::unchanged() const {
  const size_t n = watched_.size();
  if (!reusable_) {  // then plan() has recorded states_ of every watched_ tensor
    return false;
  }
  // Each tensor's check waits on two cache misses (its TensorImpl, then its storage).
  std::atomic<bool> same{true};
  over_tensors(n, [&](int64_t begin, int64_t end) {
    const auto stop = static_cast<size_t>(end);
    for (auto i = static_cast<size_t>(begin); i < stop; ++i) {
      if (i + kImplAhead < stop) {
        prefetch_object<sizeof(c10::TensorImpl)>(watched_[i + kImplAhead]->unsafeGetTensorImpl());
      }
      if (i + kStorageAhead < stop) {
        const c10::TensorImpl* impl = watched_[i + kStorageAhead]->unsafeGetTensorImpl();
        if (impl->has_storage()) {  // the whole object: the fields read straddle its lines
          prefetch_object<sizeof(c10::StorageImpl)>(impl->storage().unsafeGetStorageImpl());
        }
      }
      if (!(state_of(*watched_[i]) == states_[i])) {
        same.store(false, std::memory_order_relaxed);
        return;
      }
    }
  });
  return same.load();
}

void PreparedUpdate::plan() {
  reusable_ = false;
  states_.clear();
  watched_.clear();
  bool reusable = true;
  for (PreparedCall& call : calls_) {
    call.plans.clear();
    call.plans = plan_fused_call(fused_call_of(call), refs_of(call.emas), refs_of(call.src));
    for (const DevicePlan& p : call.plans) {
      reusable &= p.stand_ins.empty() && p.write_backs.empty();
    }
    for (const at::Tensor& t : call.emas) {
      watched_.push_back(&t);
    }
    for (const at::Tensor& t : call.src) {
      watched_.push_back(&t);
    }
  }
  for (const Copies* copies : {&staging_, &copies_}) {
    for (size_t i = 0; i < copies->dst.size(); ++i) {
      TORCH_CHECK_VALUE(copies->dst[i].sizes() == copies->src[i].sizes(), kPreparedOp,
                        "copies: source ", i, " has shape ", copies->src[i].sizes(),
                        " but its target has ", copies->dst[i].sizes());
      check_storage(copies->dst[i], kPreparedOp, "copies: target " + std::to_string(i));
      check_storage(copies->src[i], kPreparedOp, "copies: source " + std::to_string(i));
      watched_.push_back(&copies->dst[i]);
      watched_.push_back(&copies->src[i]);
    }
  }
  if (reusable) {  // stand-ins hold copies of the values they were planned with
    states_.reserve(watched_.size());
    for (const at::Tensor* t : watched_) {
      states_.push_back(state_of(*t));
    }
    reusable_ = true;
  }
}

void PreparedUpdate::advance(StepMode mode, int64_t step) {
  if (mode == StepMode::kKeep) {
    return;
  }
  for (size_t s = 0; s < schedules_.size(); s += 3) {
    const at::Tensor& counter = schedules_[s];
    if (mode == StepMode::kSet) {
      if (counter.is_cpu()) {
        *counter.mutable_data_ptr<int64_t>() = step;
      } else {
        counter.fill_(step);
      }
    }
    run_schedule(counter, schedules_[s + 1], schedules_[s + 2], mode == StepMode::kAdvance);
  }
}

void PreparedUpdate::run_call(const PreparedCall& call) {
  // The joint weights: each schedule's weight, just computed, in its slot.
  for (size_t k = 0; k < call.joint.size(); ++k) {
    const at::Tensor& out = schedules_[3 * static_cast<size_t>(call.joint[k]) + 1];
    if (call.weights.is_cpu() && out.is_cpu() && call.weights.scalar_type() == at::kDouble) {
      call.weights.mutable_data_ptr<double>()[k] = *out.const_data_ptr<double>();
    } else {
      call.weights.narrow(0, static_cast<int64_t>(k), 1).copy_(out.narrow(0, 0, 1));
    }
  }
  run_fused_call(fused_call_of(call), call.plans);
}

void PreparedUpdate::Copies::run() const {
  for (size_t i = 0; i < dst.size(); ++i) {
    const at::Tensor& d = dst[i];
    const at::Tensor& s = src[i];
    // A CPU buffer of the same dtype (num_batches_tracked) is a memcpy: copy_ costs microseconds.
    if (d.is_cpu() && s.is_cpu() && d.scalar_type() == s.scalar_type() && d.is_contiguous() &&
        s.is_contiguous()) {
      std::memcpy(d.mutable_data_ptr(), s.const_data_ptr(), d.nbytes());
      d.unsafeGetTensorImpl()->bump_version();
    } else {
      d.copy_(s);  // blocking: a copy into pinned host memory has landed when it returns
    }
  }
}

bool PreparedUpdate::run(StepMode mode, int64_t step, bool replan) {
  const NoGradScope no_grad;
  if (unchanged()) {
    // As the planner does for the calls it plans, while the check has their metadata in cache;
    // each bump is an atomic increment of a counter of its own, another miss: split as the check.
    over_tensors(written_.size(), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        written_[static_cast<size_t>(i)]->bump_version();
      }
    });
  } else if (replan) {
    plan();  // every op's checks: a refusal throws here, before anything is written
  } else {
    return false;
  }
  advance(mode, step);
  // Staged sources are copied only when they will be read: update_every's skipped steps have host
  // weights of 0 (each schedule's out: weight, decay), and cross-device copies are not free.
  bool read = false;
  for (size_t s = 1; s < schedules_.size() && !read; s += 3) {
    read = !schedules_[s].is_cpu() || *schedules_[s].const_data_ptr<double>() != 0.0;
  }
  if (read) {
    staging_.run();
  }
  for (const PreparedCall& call : calls_) {
    run_call(call);
  }
  copies_.run();
  ++runs_;
  return true;
}

}  // namespace fused_ema
