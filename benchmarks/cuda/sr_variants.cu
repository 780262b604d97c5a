// The stochastic-rounding lerp kernel against the round-to-nearest one, through the real
// multi_tensor_apply, with different packs in flight per thread (kIlp) and resident blocks per
// SM: which setting keeps SR within 10% of RN. Interleaved rounds, CUDA events, medians.
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc -Xptxas -v benchmarks/cuda/sr_variants.cu -o sr && ./sr
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "cuda/lerp_op.cuh"

namespace fc = fused_ema::cuda;

#define CHECK_CUDA(call)                                                                \
  do {                                                                                  \
    const cudaError_t err_ = (call);                                                    \
    if (err_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

template <typename Base, int kIlpV, int kMinBlocksV>
struct Variant : Base {
  static constexpr int kIlp = kIlpV;
  static constexpr int kMinBlocksPerSM = kMinBlocksV;
};

// Random values in [-2, 2), never zero-filled memory.
template <typename T>
__global__ void fill(T* out, int64_t n, uint32_t salt) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ salt;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    out[i] = static_cast<T>(static_cast<float>(h) * (4.0f / 4294967296.0f) - 2.0f);
  }
}

struct Case {
  std::string name;
  std::function<void(cudaStream_t)> run;
  std::vector<float> ms;
};

template <typename E, typename S>
void bench_pair(const char* pair, int64_t total, int tensors, int rounds, int reps) {
  E* ema = nullptr;
  S* src = nullptr;
  const int64_t per = (total / tensors + 7) / 8 * 8;
  CHECK_CUDA(cudaMalloc(&ema, per * tensors * sizeof(E)));
  CHECK_CUDA(cudaMalloc(&src, per * tensors * sizeof(S)));
  fill<<<1024, 256>>>(ema, per * tensors, 1u);
  fill<<<1024, 256>>>(src, per * tensors, 2u);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<fc::TensorRef> refs;
  std::vector<fc::SrTracks<1>> extras;
  for (int t = 0; t < tensors; ++t) {
    refs.push_back({ema + t * per, src + t * per, per});
    extras.push_back({{}, {static_cast<uint32_t>(t)}, 0});
  }
  const fc::TrackWeights<1> weight{{1e-3}, nullptr, nullptr, 0};
  const fc::SrArgs<1> sr{{5, nullptr}, {1}};
  using Sr = fc::LerpOp<E, S, 1, true>;
  std::vector<Case> cases;
  cases.push_back(
      {"RN (LerpOp)", [&](cudaStream_t s) {
         CHECK_CUDA(fc::multi_tensor_apply(refs.data(), tensors, fc::LerpOp<E, S>{weight, {}}, s));
       }});
  auto add_sr = [&](auto op, const char* name) {
    cases.push_back({name, [&, op](cudaStream_t s) {
                       CHECK_CUDA(
                           fc::multi_tensor_apply(refs.data(), tensors, op, s, extras.data()));
                     }});
  };
  add_sr(Sr{weight, sr}, "SR shipped");
  add_sr(Variant<Sr, 1, 2>{{weight, sr}}, "SR ilp1 2blk");
  add_sr(Variant<Sr, 2, 2>{{weight, sr}}, "SR ilp2 2blk");
  add_sr(Variant<Sr, 2, 1>{{weight, sr}}, "SR ilp2 1blk");
  add_sr(Variant<Sr, 4, 1>{{weight, sr}}, "SR ilp4 1blk");
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (Case& c : cases) {
    c.run(stream);  // warm-up
  }
  for (int r = 0; r < rounds; ++r) {
    for (size_t k = 0; k < cases.size(); ++k) {
      Case& c = cases[(k + r) % cases.size()];
      CHECK_CUDA(cudaEventRecord(start, stream));
      for (int i = 0; i < reps; ++i) {
        c.run(stream);
      }
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      c.ms.push_back(ms / reps);
    }
  }
  const double bytes = static_cast<double>(per) * tensors * (2 * sizeof(E) + sizeof(S));
  float rn = 0;
  for (Case& c : cases) {
    std::sort(c.ms.begin(), c.ms.end());
    const float median = c.ms[c.ms.size() / 2];
    if (rn == 0) {
      rn = median;
    }
    std::printf("%-10s %-14s %8.3f ms %7.0f GB/s %6.2fx RN\n", pair, c.name.c_str(), median,
                bytes / (median * 1e-3) / 1e9, median / rn);
  }
  CHECK_CUDA(cudaFree(ema));
  CHECK_CUDA(cudaFree(src));
  CHECK_CUDA(cudaStreamDestroy(stream));
}

int main() {
  const int64_t total = 86567656;  // ViT-B/16's parameters, in 152 tensors
  bench_pair<__nv_bfloat16, __nv_bfloat16>("bf16<-bf16", total, 152, 9, 10);
  bench_pair<__half, __half>("f16<-f16", total, 152, 9, 10);
  bench_pair<__nv_bfloat16, float>("bf16<-f32", total, 152, 9, 10);
  return 0;
}
