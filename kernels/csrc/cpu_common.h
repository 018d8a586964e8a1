// Element loads and stores shared by the CPU kernels: every op computes in fp32.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvscope {

// Written with bit casts rather than c10::BFloat16's own conversions, whose branches and
// memcpy keep the compiler from vectorizing the loops these sit in.
inline float load(float x) { return x; }
// bf16 elements are handled as their raw bits (kvscope::bf16): loops over c10::BFloat16, a
// struct, do not vectorize.
using bf16 = uint16_t;
inline float load(bf16 bits) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(bits) << 16);
}
// fp32 -> bf16 bits, rounding to nearest even (NaN stays a quiet NaN), as c10 does.
inline uint16_t bf16_bits(float x) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, x);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return x != x ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}
inline void store(float& target, float x) { target = x; }
inline void store(bf16& target, float x) { target = bf16_bits(x); }
// What storing to T and reading back gives.
inline float round_to(float x, float*) { return x; }
inline float round_to(float x, bf16*) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(bf16_bits(x)) << 16);
}

// A quantized KV cache's codes (kernels/kv_quant.py): fp8 as their raw bits, int8 as int8_t.
// A cache row is head_dim codes and then the row's bf16 scale in two code elements.
struct fp8_e4m3 {
  uint8_t bits;
};
struct fp8_e5m2 {
  uint8_t bits;
};
template <typename T>
constexpr bool kQuantizedKV =
    std::is_same_v<T, fp8_e4m3> || std::is_same_v<T, fp8_e5m2> || std::is_same_v<T, int8_t>;
constexpr int kScaleElements = 2;  // kv_quant.SCALE_ELEMENTS
// The largest code magnitude (kv_quant.CODE_MAX).
template <typename T>
constexpr float kCodeMax = std::is_same_v<T, fp8_e4m3>   ? 448.f
                           : std::is_same_v<T, fp8_e5m2> ? 57344.f
                                                         : 127.f;

inline float load(int8_t x) { return static_cast<float>(x); }
// e4m3 (bias 7, no infinities) as fp32: the 7 magnitude bits placed under fp32's exponent and
// mantissa, rescaled by 2^(127 - 7), which also gives the subnormals; exact.
inline float load(fp8_e4m3 x) {
  const float magnitude =
      __builtin_bit_cast(float, static_cast<uint32_t>(x.bits & 0x7f) << 20) * 0x1p120f;
  return x.bits & 0x80 ? -magnitude : magnitude;
}
// e5m2 is the top byte of a float16: rebias its exponent as for float16 (exact).
inline float load(fp8_e5m2 x) {
  const float magnitude =
      __builtin_bit_cast(float, static_cast<uint32_t>(x.bits & 0x7f) << 21) * 0x1p112f;
  return x.bits & 0x80 ? -magnitude : magnitude;
}

// x (already within +-max of the format) as fp8 bits with kMantissa mantissa bits and
// exponent bias kBias, rounded to nearest even, as torch's conversion rounds.
template <int kMantissa, int kBias>
inline uint8_t fp8_bits(float x) {
  const uint8_t sign = x < 0.f ? 0x80 : 0;
  const float magnitude = x < 0.f ? -x : x;
  constexpr float kMinNormal = 1.f / static_cast<float>(1 << (kBias - 1));
  if (magnitude < kMinNormal)  // subnormal steps of 2^(1 - bias - mantissa): exact scaling
    return sign | static_cast<uint8_t>(
                      std::nearbyint(magnitude * static_cast<float>(1 << (kBias - 1 + kMantissa))));
  constexpr int kDropped = 23 - kMantissa;
  uint32_t bits = __builtin_bit_cast(uint32_t, magnitude);
  bits += (1u << (kDropped - 1)) - 1 + ((bits >> kDropped) & 1u);  // a carry bumps the exponent
  const uint32_t exponent = (bits >> 23) - 127 + kBias;
  const uint32_t mantissa = (bits >> kDropped) & ((1u << kMantissa) - 1);
  return sign | static_cast<uint8_t>(exponent << kMantissa | mantissa);
}

// A scaled value (x / scale, clamped to +-kCodeMax) as a code.
inline void store(int8_t& target, float x) { target = static_cast<int8_t>(std::nearbyint(x)); }
inline void store(fp8_e4m3& target, float x) { target.bits = fp8_bits<3, 7>(x); }
inline void store(fp8_e5m2& target, float x) { target.bits = fp8_bits<2, 15>(x); }

// Asks for the cache line holding p, into the core's L2 (prefetcht1) rather than L1: a core
// has only a couple of dozen L1 miss buffers, and requests into L1 (software prefetch or
// demand loads alike) cap how fast a single decode's scattered KV blocks arrive; into L2 the
// requests queue past that limit (docs/performance-history.md, 'Memory requests'). Not
// __builtin_prefetch: GCC 12 drops that from loops it transforms.
inline void prefetch_to_l2(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Weight bytes ahead of the row being dotted that a streaming kernel requests with a software
// prefetch: with the hardware prefetchers alone, compute and memory take turns instead of
// overlapping. docs/performance-history.md, 'Quantized linears (quantized/)', has the distances
// measured.
constexpr int64_t kPrefetchBytes = 8192;

// Requests into L2 the `row_bytes` bytes kPrefetchBytes past `row`, short of `limit` (the end
// of the caller's stream): called once per row streamed, it keeps every line of the stream
// requested that far ahead.
inline void prefetch_ahead(const void* row, int64_t row_bytes, const void* limit) {
  const char* ahead = static_cast<const char*>(row) + kPrefetchBytes;
  const char* stop = std::min(ahead + row_bytes, static_cast<const char*>(limit));
  for (const char* line = ahead; line < stop; line += 64) prefetch_to_l2(line);
}

// 2^f for f in [-0.5, 0.5] (a degree-6 polynomial): for a float, or lane by lane for a vector
// of GCC's vector extension (vec.hpp's exp_nonpositive).
template <typename T>
inline T exp2_of_fraction(T f) {
  T p = 1.535336188319500e-4f * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  return p * f + 1.f;
}

// exp(x) for x <= 0 (softmax weights, silu's exp(-|g|)) in a form the compiler vectorizes
// (std::exp is a scalar call unless -ffast-math): 2^n * 2^f with Cephes' exp2f polynomial,
// within ~2 ulp of std::exp. Below -87 the result underflows to ~1e-38, i.e. 0 here.
inline float exp_nonpositive(float x) {
  const float t = (x > -87.f ? x : -87.f) * 1.44269504088896341f;  // x / ln 2
  // Round to nearest by adding and removing 1.5 * 2^23 (exact for |t| < 2^22): std::floor
  // and std::max (a reference) both keep GCC from vectorizing the callers' loops.
  const float n = (t + 12582912.f) - 12582912.f;
  const float p = exp2_of_fraction(t - n);
  const int32_t exponent = (static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, exponent);
}

// silu(g) = g sigmoid(g), with sigmoid(g) from e = exp(-|g|) as 1/(1+e) or e/(1+e): never
// overflows, and vectorizes.
inline float silu(float g) {
  const float e = exp_nonpositive(-std::abs(g));
  return g * ((g >= 0.f ? 1.f : e) / (1.f + e));
}

// A tensor's elements as the kernels' element type (float or bf16 bits).
template <typename T>
T* elements(const at::Tensor& tensor) {
  return static_cast<T*>(tensor.data_ptr());
}

// Calls body(std::integral_constant<int, rows>) for rows in 1..M: each row count is a
// compile-time constant, so a kernel's per-row accumulators stay in registers.
template <int M, typename Body>
void with_rows(int rows, Body&& body) {
  if constexpr (M > 1) {
    if (rows < M) return with_rows<M - 1>(rows, body);
  }
  body(std::integral_constant<int, M>{});
}

// Calls body(std::integral_constant<int, count>, first) for rows [first, first + count) of
// `rows`, in groups of M (the last one shorter): any number of rows through a kernel whose
// row count is a compile-time constant.
template <int M, typename Body>
void by_row_groups(int64_t rows, Body&& body) {
  for (int64_t first = 0; first < rows; first += M)
    with_rows<M>(static_cast<int>(std::min<int64_t>(M, rows - first)),
                 [&](auto count) { body(count, first); });
}
}  // namespace kvscope
