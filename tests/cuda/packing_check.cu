// Host-only check of multi_tensor_apply's packing, run by test_cuda_packing.py without a GPU:
// synthetic tensors (fake addresses, never dereferenced) are packed with both metadata layouts;
// every tensor must land in one launch and every element in exactly one block. Prints the
// kernel-parameter sizes, then "ok" or the failures.
#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda/lerp_op.cuh"

namespace fc = fused_ema::cuda;

namespace {

int failures = 0;

#define CHECK(cond, ...)                        \
  do {                                          \
    if (!(cond) && ++failures <= 20) {          \
      std::fprintf(stderr, "FAIL %s: ", #cond); \
      std::fprintf(stderr, __VA_ARGS__);        \
      std::fprintf(stderr, "\n");               \
    }                                           \
  } while (0)

struct Tensor {
  uintptr_t ema;
  uintptr_t src;
  int64_t numel;
};

// Sizes around the chunk and pack edges (multi-chunk ones among the first 40 tensors only, to
// keep the element count small), both sides misaligned in every way a view can be.
template <typename E, typename S>
std::vector<Tensor> synthetic_tensors(int count) {
  const int64_t sizes[] = {0,  1,  2,    3,    7,     8,     9,     15,     16,     17,
                           31, 33, 1000, 4097, 65535, 65536, 65537, 131077, 196607, 200003};
  constexpr int kSmallSizes = 13;
  std::vector<Tensor> tensors;
  for (int i = 0; i < count; ++i) {
    const int64_t numel = sizes[(i * 7) % (i < 40 ? 20 : kSmallSizes)];
    const uintptr_t base = (uintptr_t{1} << 40) + uintptr_t(i) * (uintptr_t{1} << 24);
    tensors.push_back(
        {base + sizeof(E) * (i % 5), base + (uintptr_t{1} << 23) + sizeof(S) * (i % 3), numel});
  }
  return tensors;
}

template <typename E, typename S, int kCapacity>
void check_coverage(int count) {
  constexpr int kPack = fc::LerpOp<E, S>::kPack;
  const std::vector<Tensor> tensors = synthetic_tensors<E, S>(count);
  std::vector<fc::TensorRef> refs;
  std::vector<std::vector<uint8_t>> hits;
  for (const Tensor& t : tensors) {
    refs.push_back({reinterpret_cast<void*>(t.ema), reinterpret_cast<const void*>(t.src), t.numel});
    hits.emplace_back(static_cast<size_t>(t.numel), 0);
  }
  std::vector<int> launches_of(tensors.size(), 0);
  size_t next = 0;  // tensors are packed in order: launch k holds the next num_tensors non-empty
  int launches = 0;
  int nonempty = 0;
  for (const Tensor& t : tensors) {
    nonempty += t.numel > 0;
  }
  fc::LaunchMeta<kCapacity> meta;
  const cudaError_t err = fc::pack_launches<E, S, kPack>(
      refs.data(), static_cast<int64_t>(refs.size()), meta,
      [&](const fc::LaunchMeta<kCapacity>& m, int64_t blocks) {
        ++launches;
        CHECK(m.num_tensors >= 1 && m.num_tensors <= kCapacity, "num_tensors %d", m.num_tensors);
        CHECK(blocks >= 1 && blocks <= INT32_MAX, "blocks %lld", static_cast<long long>(blocks));
        CHECK(m.first_block[0] == 0, "first block %d", m.first_block[0]);
        CHECK(m.first_block[m.num_tensors] == blocks, "block count");
        std::vector<size_t> index(m.num_tensors);
        for (int k = 0; k < m.num_tensors; ++k) {
          while (next < tensors.size() && tensors[next].numel == 0) {
            ++next;
          }
          CHECK(next < tensors.size() && m.ema[k] == refs[next].ema && m.src[k] == refs[next].src &&
                    m.numel[k] == refs[next].numel,
                "slot %d is not tensor %zu", k, next);
          CHECK(m.first_block[k] < m.first_block[k + 1], "tensor %zu has no block", next);
          index[k] = next;
          ++launches_of[next];
          // The head is the first count of elements after which both sides are 16-byte aligned.
          int head = -1;
          for (int j = kPack - 1; j >= 0; --j) {
            if ((tensors[next].ema + j * sizeof(E)) % 16 == 0 &&
                (tensors[next].src + j * sizeof(S)) % 16 == 0) {
              head = static_cast<int>(j < tensors[next].numel ? j : tensors[next].numel);
            }
          }
          CHECK(m.head[k] == head, "tensor %zu head %d, expected %d", next, m.head[k], head);
          ++next;
        }
        for (int32_t b = 0; b < blocks; ++b) {
          const fc::BlockWork w = fc::block_work<kPack>(m, b);
          std::vector<uint8_t>& h = hits[index[w.tensor]];
          CHECK(w.end - w.begin <= fc::kChunkElems && w.begin < w.end + (w.scalars > 0),
                "block %d range %lld..%lld", b, static_cast<long long>(w.begin),
                static_cast<long long>(w.end));
          CHECK(w.scalars < fc::kBlockThreads, "block %d has %lld scalars", b,
                static_cast<long long>(w.scalars));
          for (int64_t i = w.begin; i < w.end; ++i) {
            if (w.head < 0) {
              ++h[i];
            } else {
              for (int k = 0; k < kPack; ++k) {
                ++h[w.head + i * kPack + k];
              }
            }
          }
          for (int64_t s = 0; s < w.scalars; ++s) {
            ++h[s < w.head ? s : w.tail_begin + (s - w.head)];
          }
        }
        return cudaSuccess;
      });
  CHECK(err == cudaSuccess, "pack_launches returned %d", static_cast<int>(err));
  CHECK(launches == (nonempty + kCapacity - 1) / kCapacity, "%d launches for %d tensors", launches,
        nonempty);
  for (size_t t = 0; t < tensors.size(); ++t) {
    CHECK(launches_of[t] == (tensors[t].numel > 0 ? 1 : 0), "tensor %zu in %d launches", t,
          launches_of[t]);
    for (int64_t i = 0; i < tensors[t].numel; ++i) {
      if (hits[t][i] != 1) {
        CHECK(false, "tensor %zu element %lld updated %d times (capacity %d)", t,
              static_cast<long long>(i), hits[t][i], kCapacity);
        break;
      }
    }
  }
}

// Launches stay within INT32_MAX blocks: huge (fake) tensors force a flush before the count
// overflows, and a tensor needing more blocks alone is refused.
template <int kCapacity>
void check_block_limit() {
  const int64_t numel = int64_t{1} << 45;  // 2^29 blocks of 65,536 elements
  std::vector<fc::TensorRef> refs(
      5, fc::TensorRef{reinterpret_cast<void*>(uintptr_t{1} << 40),
                       reinterpret_cast<const void*>(uintptr_t{1} << 41), numel});
  std::vector<int> sizes;
  fc::LaunchMeta<kCapacity> meta;
  cudaError_t err = fc::pack_launches<float, float, 4>(
      refs.data(), 5, meta, [&](const fc::LaunchMeta<kCapacity>& m, int64_t blocks) {
        CHECK(blocks <= INT32_MAX, "blocks %lld", static_cast<long long>(blocks));
        sizes.push_back(m.num_tensors);
        return cudaSuccess;
      });
  CHECK(err == cudaSuccess && sizes.size() == 2 && sizes[0] == 3 && sizes[1] == 2,
        "INT32_MAX flush: %zu launches", sizes.size());
  refs[2].numel = int64_t{1} << 48;
  sizes.clear();
  err = fc::pack_launches<float, float, 4>(refs.data(), 5, meta,
                                           [&](const fc::LaunchMeta<kCapacity>& m, int64_t) {
                                             sizes.push_back(m.num_tensors);
                                             return cudaSuccess;
                                           });
  CHECK(err == cudaErrorInvalidValue, "oversized tensor accepted: %d", static_cast<int>(err));
  // The first error of a launch stops the packing.
  int calls = 0;
  err = fc::pack_launches<float, float, 4>(refs.data(), 2, meta,
                                           [&](const fc::LaunchMeta<kCapacity>&, int64_t) {
                                             ++calls;
                                             return cudaErrorLaunchFailure;
                                           });
  CHECK(err == cudaErrorLaunchFailure && calls == 1, "error not returned");
}

template <int kCapacity>
void check_all(int count) {
  check_coverage<float, float, kCapacity>(count);
  check_coverage<float, __nv_bfloat16, kCapacity>(count);
  check_coverage<float, __half, kCapacity>(count);
  check_coverage<__nv_bfloat16, __nv_bfloat16, kCapacity>(count);
  check_coverage<__half, __half, kCapacity>(count);
  check_coverage<double, double, kCapacity>(count);
  check_block_limit<kCapacity>();
}

}  // namespace

int main() {
  // Kernel parameters: the metadata plus the op (LerpOp's weight).
  std::printf("small_meta %zu\nlarge_meta %zu\nop %zu\nlarge_compiled %d\n",
              sizeof(fc::LaunchMeta<fc::kSmallCapacity>),
              sizeof(fc::LaunchMeta<fc::kLargeCapacity>), sizeof(fc::LerpOp<float, float>),
              static_cast<int>(fc::kLargeParamsCompiled));
  for (const int count : {1, 119, 120, 121, 241, 1023, 1024, 1025, 2100}) {
    check_all<fc::kSmallCapacity>(count);
    check_all<fc::kLargeCapacity>(count);
  }
  std::printf(failures == 0 ? "ok\n" : "%d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
