// Element loads and stores shared by the CPU kernels: every op computes in fp32.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>

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

// Asks for the cache line holding p, into the core's L2 (prefetcht1) rather than L1: a core
// has only a couple of dozen L1 miss buffers, and requests into L1 (software prefetch or
// demand loads alike) cap how fast a single decode's scattered KV blocks arrive; into L2 the
// requests queue past that limit (docs/performance.md). Not __builtin_prefetch: GCC 12 drops
// that from loops it transforms.
inline void prefetch_to_l2(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// exp(x) for x <= 0 (softmax weights, silu's exp(-|g|)) in a form the compiler vectorizes
// (std::exp is a scalar call unless -ffast-math): 2^n * 2^f with Cephes' exp2f polynomial,
// within ~2 ulp of std::exp. Below -87 the result underflows to ~1e-38, i.e. 0 here.
inline float exp_nonpositive(float x) {
  const float t = (x > -87.f ? x : -87.f) * 1.44269504088896341f;  // x / ln 2
  // Round to nearest by adding and removing 1.5 * 2^23 (exact for |t| < 2^22): std::floor
  // and std::max (a reference) both keep GCC from vectorizing the callers' loops.
  const float n = (t + 12582912.f) - 12582912.f;
  const float f = t - n;  // [-0.5, 0.5]
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  const int32_t exponent = (static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, exponent);
}

// A tensor's elements as the kernels' element type (float or bf16 bits).
template <typename T>
T* elements(const at::Tensor& tensor) {
  return static_cast<T*>(tensor.data_ptr());
}
}  // namespace kvscope
