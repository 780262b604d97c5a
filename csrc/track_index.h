// TrackIndex: a pair's track and tensor from its index k * tensors + i, without a division. No
// torch headers: the CPU runner, the driver and the CUDA launch packing (csrc/cuda) share it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fused_ema {

// The track k and tensor i of a pair's FlatPair::index, k * tensors + i, by a multiply and a shift
// (Lemire's fastdiv for 32-bit values): a division per pair shows in profiles of 20,000 tensors.
class TrackIndex {
 public:
  explicit TrackIndex(size_t tensors)
      : tensors_(static_cast<uint32_t>(tensors)),
        magic_(tensors > 1 ? UINT64_MAX / tensors + 1 : 0) {}

  uint32_t track(uint32_t index) const {
    return tensors_ > 1 ? static_cast<uint32_t>((static_cast<__uint128_t>(magic_) * index) >> 64)
                        : index;
  }
  uint32_t tensor(uint32_t index) const { return index - track(index) * tensors_; }

 private:
  uint32_t tensors_;
  uint64_t magic_;
};

}  // namespace fused_ema
