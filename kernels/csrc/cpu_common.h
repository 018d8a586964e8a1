// Element loads and stores shared by the CPU kernels: every op computes in fp32.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace kvscope {

inline float load(float x) { return x; }
inline float load(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}
inline void store(float& target, float x) { target = x; }
inline void store(c10::BFloat16& target, float x) { target = c10::BFloat16(x); }
// What storing to T and reading back gives (round to nearest even for bf16).
inline float round_to(float x, float*) { return x; }
inline float round_to(float x, c10::BFloat16*) { return load(c10::BFloat16(x)); }

}  // namespace kvscope
