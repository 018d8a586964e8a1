// The int8-dot path of gguf_linear for bf16 activations on a CPU with AVX512-VNNI. For the
// 32-weight types (Q4_0..Q8_0) x is rounded per 32 values (vnni.h's Q8_0 rows), see
// block32_dot. For the k-quants (Q4_K, Q5_K, Q6_K) with bf16 activations
// on a CPU with AVX512-VNNI, after llama.cpp's: each row of x is rounded to int8 once per call
// with one scale per 256 values (llama.cpp's q8_K, whose super-blocks are the weights'), and
// per super-block every weight's unsigned quant meets x's int8 in vpmaddubsw (pairs into
// int16), whose pairs vpdpwssd multiplies by the sub-block's integer scale into int32: a
// super-block's dot is exact integer arithmetic, scaled once by d * d_x in fp32. The mins
// (Q4_K, Q5_K) and Q6_K's offset of 32 meet x's sums per sub-block, also in integers. That
// rounding of the activations is the one approximation (tests/test_gguf_blocks.py holds the
// kernel to the rounded x's exact product).
#pragma once

#include "quantized/kquants_blocks.h"
#include "quantized/vnni.h"

#if defined(KVSCOPE_VNNI_DOTS)
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace kvscope::quantized::kquants {

constexpr int64_t kSuper = 256;  // weights per k-quant super-block, x values per scale

// Where x's 32-value sub-block s of a super-block sits for Q4_K / Q5_K: one 64-byte load
// of nibbles holds chunks 2i and 2i + 1 (64 weights each, low nibbles the first 32), so its
// low nibbles are sub-blocks 4i and 4i + 2 and its high ones 4i + 1 and 4i + 3; x is laid
// out as those four 64-byte operands. Q6_K's operands are x's own order.
inline int64_t k4_position(int s) { return (2 * (s / 4) + s % 2) * 64 + (s % 4) / 2 * 32; }

// Rows of bf16 x rounded per super-block: d = max|x| / 127, q = round(x * (1 / d)) (ties to
// even), and the sums of q per 16 and per 32 values (x's order).
struct SuperRows {
  int64_t blocks = 0;
  std::vector<int8_t> q;        // [rows][blocks][256], in the order the type's dots read
  std::vector<float> d;         // [rows][blocks]
  std::vector<int16_t> sums16;  // [rows][blocks][16]
  std::vector<int16_t> sums32;  // [rows][blocks][8]
};

inline SuperRows quantize_super_rows(const bf16* x, int64_t x_stride, int rows, int64_t in,
                                     bool k4_order) {
  SuperRows r;
  r.blocks = in / kSuper;
  r.q.assign(rows * in, 0);
  r.d.assign(rows * r.blocks, 0.f);
  r.sums16.assign(rows * r.blocks * 16, 0);
  r.sums32.assign(rows * r.blocks * 8, 0);
  for (int m = 0; m < rows; ++m)
    for (int64_t b = 0; b < r.blocks; ++b) {
      const bf16* values = x + m * x_stride + b * kSuper;
      __m512 v[16], amax = _mm512_setzero_ps();
      for (int g = 0; g < 16; ++g) {
        v[g] = load_bf16x16(values + 16 * g, 0xFFFF);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v[g]));
      }
      const float d = _mm512_reduce_max_ps(amax) / 127.f;
      const __m512 inverse = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
      const int64_t at = m * r.blocks + b;
      r.d[at] = d;
      for (int g = 0; g < 16; ++g) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[g], inverse));
        r.sums16[at * 16 + g] = static_cast<int16_t>(_mm512_reduce_add_epi32(q));
        const int64_t position = k4_order ? k4_position(g / 2) + g % 2 * 16 : 16 * g;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q.data() + at * kSuper + position),
                         _mm512_cvtsepi32_epi8(q));
      }
      for (int s = 0; s < 8; ++s)
        r.sums32[at * 8 + s] = r.sums16[at * 16 + 2 * s] + r.sums16[at * 16 + 2 * s + 1];
    }
  return r;
}

// 32 int16 lanes: lanes 0..15 `first`, lanes 16..31 `second` (a per-half index or shift).
inline __m512i halves_epi16(int16_t first, int16_t second) {
  return _mm512_inserti64x4(_mm512_set1_epi16(first), _mm256_set1_epi16(second), 1);
}

inline __m512i operand(const SuperRows& xq, int64_t at, int o) {
  return _mm512_loadu_si512(xq.q.data() + at * kSuper + 64 * o);
}

inline float half_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

inline float reduce_add_128(__m128 v) {
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

// y[m] = row . x[x_first + m] for a Q4_K (kFive false) or Q5_K row of `blocks` super-blocks.
template <int M, bool kFive>
inline void k4_dot(const SuperRows& xq, int x_first, const uint8_t* row, float (&y)[M]) {
  constexpr int64_t kBytes = kFive ? 176 : 144;
  const __m512i nibble = _mm512_set1_epi8(0x0F), bit = _mm512_set1_epi8(0x01);
  __m512 acc[M];
  __m128 mins_acc[M];
  for (int m = 0; m < M; ++m) {
    acc[m] = _mm512_setzero_ps();
    mins_acc[m] = _mm_setzero_ps();
  }
  for (int64_t b = 0; b < xq.blocks; ++b) {
    const uint8_t* block = row + b * kBytes;
    const float d = half_float(block), dmin = half_float(block + 2);
    uint32_t u[4];
    unpack_k4_scales(block + 4, u);
    const __m256i scales_mins =
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<__m128i*>(u)));
    const __m512i scales = _mm512_castsi256_si512(scales_mins);
    const __m128i mins = _mm256_extracti128_si256(scales_mins, 1);
    const uint8_t* qs = block + (kFive ? 48 : 16);
    __m512i high_bits = _mm512_setzero_si512();
    if constexpr (kFive)
      high_bits =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16)));
    __m512i dots[M];
    for (int m = 0; m < M; ++m) dots[m] = _mm512_setzero_si512();
    for (int i = 0; i < 2; ++i) {
      const __m512i packed = _mm512_loadu_si512(qs + 64 * i);
      for (int high = 0; high < 2; ++high) {
        const int o = 2 * i + high;  // sub-blocks 4i + high and 4i + 2 + high
        const int16_t first = 4 * i + high, second = 4 * i + 2 + high;
        __m512i w = _mm512_and_si512(high ? _mm512_srli_epi16(packed, 4) : packed, nibble);
        if constexpr (kFive)  // sub-block s's 5th bit is bit s of its 32 bytes
          w = _mm512_or_si512(
              w,
              _mm512_slli_epi16(
                  _mm512_and_si512(_mm512_srlv_epi16(high_bits, halves_epi16(first, second)), bit),
                  4));
        const __m512i scale = _mm512_permutexvar_epi16(halves_epi16(first, second), scales);
        for (int m = 0; m < M; ++m) {
          const __m512i pairs =
              _mm512_maddubs_epi16(w, operand(xq, (x_first + m) * xq.blocks + b, o));
          dots[m] = _mm512_dpwssd_epi32(dots[m], pairs, scale);
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      const int64_t at = (x_first + m) * xq.blocks + b;
      const float dx = xq.d[at];
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[m]), _mm512_set1_ps(d * dx), acc[m]);
      const __m128i mins_dot = _mm_madd_epi16(
          mins, _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq.sums32.data() + at * 8)));
      mins_acc[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(mins_dot), _mm_set1_ps(dmin * dx), mins_acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) y[m] = _mm512_reduce_add_ps(acc[m]) - reduce_add_128(mins_acc[m]);
}

// int16 lane k of Q6_K operand o (128 weights per half h = o / 2, 64 per operand) holds
// weights 2k, 2k + 1 of it: 16-weight group 4o + k / 8, the index of its scale.
inline __m512i q6_scale_lanes(int o) {
  alignas(64) int16_t index[32];
  for (int k = 0; k < 32; ++k) index[k] = static_cast<int16_t>(4 * o + k / 8);
  return _mm512_load_si512(index);
}

// y[m] = row . x[x_first + m] for a Q6_K row: q = (low nibble | 2 high bits << 4) in 0..63,
// w = d * sc * (q - 32): the dots take q as it is and the 32 * sc * sum(x) comes off after.
template <int M>
inline void q6_dot(const SuperRows& xq, int x_first, const uint8_t* row, float (&y)[M]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), two_bits = _mm512_set1_epi8(0x03);
  const __m512i scale_lanes[4] = {q6_scale_lanes(0), q6_scale_lanes(1), q6_scale_lanes(2),
                                  q6_scale_lanes(3)};
  __m512 acc[M];
  __m256 offset_acc[M];
  for (int m = 0; m < M; ++m) {
    acc[m] = _mm512_setzero_ps();
    offset_acc[m] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < xq.blocks; ++b) {
    const uint8_t* block = row + b * 210;
    const float d = half_float(block + 208);
    const __m256i scales16 =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)));
    const __m512i scales = _mm512_castsi256_si512(scales16);
    __m512i dots[M];
    for (int m = 0; m < M; ++m) dots[m] = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const __m512i low = _mm512_loadu_si512(block + 64 * h);
      const __m512i high_bits = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h)));
      for (int upper = 0; upper < 2; ++upper) {  // weights 64 * upper.. of the half
        const int o = 2 * h + upper;
        const __m512i nibbles = _mm512_and_si512(upper ? _mm512_srli_epi16(low, 4) : low, nibble);
        const __m512i top = _mm512_and_si512(
            _mm512_srlv_epi16(high_bits, halves_epi16(4 * upper, 4 * upper + 2)), two_bits);
        const __m512i w = _mm512_or_si512(nibbles, _mm512_slli_epi16(top, 4));
        const __m512i scale = _mm512_permutexvar_epi16(scale_lanes[o], scales);
        for (int m = 0; m < M; ++m) {
          const __m512i pairs =
              _mm512_maddubs_epi16(w, operand(xq, (x_first + m) * xq.blocks + b, o));
          dots[m] = _mm512_dpwssd_epi32(dots[m], pairs, scale);
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      const int64_t at = (x_first + m) * xq.blocks + b;
      const float dx = xq.d[at];
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[m]), _mm512_set1_ps(d * dx), acc[m]);
      const __m256i offset_dot = _mm256_madd_epi16(
          scales16,
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.sums16.data() + at * 16)));
      offset_acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(offset_dot), _mm256_set1_ps(32.f * d * dx),
                                      offset_acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    const __m256 o = offset_acc[m];
    y[m] = _mm512_reduce_add_ps(acc[m]) -
           reduce_add_128(_mm_add_ps(_mm256_castps256_ps128(o), _mm256_extractf128_ps(o, 1)));
  }
}

// The 32-weight types (ggml ids: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8) against x rounded
// per 32 values (vnni.h's Int8Rows, llama.cpp's Q8_0): each block is w = scale * u + c with
// unsigned quants u (Q8_0's flipped by +128), so its dot with the rounded x is
// scale * d_x * (u . q_x) + c * (d_x * sum(q_x)), one vpdpbusd over its 32 bytes.
template <int64_t kType>
struct Block32 {
  static constexpr int64_t kBytes = block32_bytes(kType);
  static constexpr bool kMin = block32_has_min(kType), kFifth = block32_has_fifth_bits(kType);

  // The block's unsigned quants, x's order, and its scale and constant term.
  static __m256i quants(const uint8_t* block, float& scale, float& c) {
    scale = half_float(block);
    c = kMin ? half_float(block + 2) : block32_offset_per_d(kType) * scale;
    if constexpr (kType == 8) {
      return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2)),
                              _mm256_set1_epi8(-128));
    } else {
      const uint8_t* qs = block + (kMin ? 4 : 2) + (kFifth ? 4 : 0);
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
      const __m128i nibble = _mm_set1_epi8(0x0F);
      __m256i u = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(packed, nibble)),
                                          _mm_and_si128(_mm_srli_epi16(packed, 4), nibble), 1);
      if constexpr (kFifth) {
        uint32_t bits;
        std::memcpy(&bits, block + (kMin ? 4 : 2), 4);
        u = _mm256_or_si256(u, _mm256_maskz_mov_epi8(_cvtu32_mask32(bits), _mm256_set1_epi8(16)));
      }
      return u;
    }
  }
};

// y[m] = row . x[x_first + m] for a row of `blocks` 32-weight blocks of type kType.
template <int M, int64_t kType>
inline void block32_dot(const Int8Rows& xq, int x_first, const uint8_t* row, float (&y)[M]) {
  __m256 acc[M];
  float constant[M];
  for (int m = 0; m < M; ++m) {
    acc[m] = _mm256_setzero_ps();
    constant[m] = 0.f;
  }
  for (int64_t b = 0; b < xq.blocks; ++b) {
    float scale, c;
    const __m256i u = Block32<kType>::quants(row + b * Block32<kType>::kBytes, scale, c);
    for (int m = 0; m < M; ++m) {
      const int64_t at = (x_first + m) * xq.blocks + b;
      const __m256i dot = _mm256_dpbusd_epi32(
          _mm256_setzero_si256(), u,
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + at * 32)));
      acc[m] =
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale * xq.scales[at]), acc[m]);
      constant[m] += c * xq.block_sums[at];
    }
  }
  for (int m = 0; m < M; ++m) {
    const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
    y[m] = reduce_add_128(sum) + constant[m];
  }
}

}  // namespace kvscope::quantized::kquants

#endif  // KVSCOPE_VNNI_DOTS
