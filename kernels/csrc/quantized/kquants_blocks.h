// What gguf_linear's int8 dots (kquants_dots.h) and its lanes (kquants.cpp) read alike from
// ggml's blocks, whatever the instruction set.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvscope::quantized::kquants {

// Q4_K / Q5_K's 12 bytes of 6-bit scales and mins unpacked to 8 bytes of each, llama.cpp's
// way: bytes 0..7 of `u` the 8 sub-blocks' scales, bytes 8..15 their mins.
inline void unpack_k4_scales(const uint8_t* packed, uint32_t (&u)[4]) {
  std::memcpy(u, packed, 12);
  u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
  const uint32_t scales_high = u[1] & 0x3f3f3f3f;
  u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
  u[2] = scales_high;
  u[0] &= 0x3f3f3f3f;
}

// The 32-weight types by ggml id (Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8): a block's bytes,
// whether it stores a min after d, and whether it stores 4 bytes of 5th bits.
constexpr int64_t block32_bytes(int64_t type) {
  return type == 2 ? 18 : type == 3 ? 20 : type == 6 ? 22 : type == 7 ? 24 : 34;
}
constexpr bool block32_has_min(int64_t type) { return type == 3 || type == 7; }
constexpr bool block32_has_fifth_bits(int64_t type) { return type == 6 || type == 7; }
// The offset of a type without a min, as a multiple of its d: w = d * u + that * d for its
// unsigned quants u (Q4_0 -8, Q5_0 -16, Q8_0's q + 128 -128); 0 for Q4_1 / Q5_1.
constexpr float block32_offset_per_d(int64_t type) {
  return type == 2 ? -8.f : type == 6 ? -16.f : type == 8 ? -128.f : 0.f;
}

}  // namespace kvscope::quantized::kquants
