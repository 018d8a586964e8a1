// The read-bandwidth probe (engine/worker/memory_bandwidth.py): every int64 word of a buffer
// summed, split over the threads the kernels run on (work_pool.h), one contiguous share each,
// as a weight's rows are streamed. The sum is the work's witness (a loop whose result nobody
// reads may be dropped by the compiler) and a check against torch's: integer addition wraps,
// so any order gives the same total. One vector add per 64-byte load keeps the loop bound by
// memory, not by arithmetic, where a float reduction (torch's sum) can fall behind it.
#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>

#include "cpu_ops.h"
#include "work_pool.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Wrapping sum of words [0, n): four independent vector sums, so loads are never waiting on
// the add before them.
uint64_t sum_words(const uint64_t* words, int64_t n) {
  int64_t i = 0;
  uint64_t total = 0;
#if defined(__AVX512F__)
  __m512i sums[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                     _mm512_setzero_si512()};
  for (; i + 32 <= n; i += 32)
    for (int s = 0; s < 4; ++s)
      sums[s] = _mm512_add_epi64(sums[s], _mm512_loadu_si512(words + i + 8 * s));
  for (const __m512i& sum : sums) total += static_cast<uint64_t>(_mm512_reduce_add_epi64(sum));
#else
  uint64_t lanes[8] = {};
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += words[i + l];
  for (uint64_t lane : lanes) total += lane;
#endif
  for (; i < n; ++i) total += words[i];
  return total;
}

}  // namespace

int64_t read_words(const at::Tensor& words) {
  TORCH_CHECK(words.device().is_cpu() && words.scalar_type() == at::kLong && words.is_contiguous(),
              "read_words: a contiguous CPU int64 tensor");
  const auto* data = reinterpret_cast<const uint64_t*>(words.data_ptr<int64_t>());
  const int64_t n = words.numel();
  std::atomic<uint64_t> total{0};
  kvscope::parallel_for(0, n, kvscope::one_share_per_thread(n), [&](int64_t begin, int64_t end) {
    total.fetch_add(sum_words(data + begin, end - begin), std::memory_order_relaxed);
  });
  return static_cast<int64_t>(total.load());
}
