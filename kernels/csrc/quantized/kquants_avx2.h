// The int8-dot path of gguf_linear for bf16 activations on a CPU with AVX2 but without
// AVX512-VNNI (Zen 3, Haswell to Alder Lake), after llama.cpp's AVX2 dots: the same
// arithmetic as kquants_vnni.h, in 256-bit registers and without vpdpwssd / vpdpbusd.
// x is rounded to int8 once per call, one scale per 256 values for the k-quants (q8_K) and
// per 32 for Q4_0..Q8_0 (Q8_0), and kept in its own order. Per 32 weights, vpmaddubsw
// multiplies the unsigned quants by x's int8 into int16 pairs and vpmaddwd sums those pairs
// times the sub-block's integer scale (or 1) into int32, exact: a k-quant super-block's dot
// is one integer sum scaled by d * d_x in fp32, as on VNNI. The pairs cannot saturate
// int16: the largest quant is 63 (Q6_K), and Q8_0's signed quants go in as |q| against x
// carrying q's sign (vpsignb), at most 128 * 127 per product. The mins (Q4_K, Q5_K), Q6_K's
// offset of 32 and the 32-weight types' constants meet x's sums per 16 or 32 values.
// The interface (Int8Rows, SuperRows, quantize_rows, quantize_super_rows, k4_dot, q6_dot,
// block32_dot) is kquants_vnni.h's, so kquants.cpp's driver runs either.
#pragma once

#include "quantized/kquants_blocks.h"
#include "quantized/vnni.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(KVSCOPE_VNNI_DOTS)
#define KVSCOPE_AVX2_DOTS 1
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace kvscope::quantized {
namespace kquants {

constexpr int64_t kSuper = 256;  // weights per k-quant super-block, x values per scale

// x's rows rounded per `block` values: d = max|x| / 127 and q = round(x * (1 / d)), ties
// to even (the VNNI path's rounding), and the sum of q per 16 values. in % block == 0.
struct RoundedRows {
  int64_t blocks = 0;
  std::vector<int8_t> q;        // [rows][blocks * block], x's order
  std::vector<float> d;         // [rows][blocks]
  std::vector<int16_t> sums16;  // [rows][in / 16]
};

inline __m256 load_bf16x8(const bf16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline RoundedRows round_rows(const bf16* x, int64_t x_stride, int rows, int64_t in,
                              int64_t block) {
  RoundedRows r;
  r.blocks = in / block;
  r.q.resize(rows * in);
  r.d.resize(rows * r.blocks);
  r.sums16.resize(rows * in / 16);
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 values[kSuper / 8];  // one block of x; block is 32 or kSuper
  for (int m = 0; m < rows; ++m)
    for (int64_t b = 0; b < r.blocks; ++b) {
      __m256 amax = _mm256_setzero_ps();
      for (int64_t g = 0; g < block / 8; ++g) {
        values[g] = load_bf16x8(x + m * x_stride + b * block + 8 * g);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, values[g]));
      }
      __m128 max4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      max4 = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
      const float d = _mm_cvtss_f32(_mm_max_ss(max4, _mm_movehdup_ps(max4))) / 127.f;
      const __m256 inverse = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
      const int64_t at = m * r.blocks + b;
      r.d[at] = d;
      for (int64_t g = 0; g < block / 16; ++g) {
        // vcvtps2dq rounds to nearest, ties to even (the MXCSR default), as on VNNI.
        const __m256i low = _mm256_cvtps_epi32(_mm256_mul_ps(values[2 * g], inverse));
        const __m256i high = _mm256_cvtps_epi32(_mm256_mul_ps(values[2 * g + 1], inverse));
        // int32 to int8, saturating; the packs interleave 128-bit lanes, so the bytes come
        // out as low[0..3] high[0..3] low[4..7] high[4..7]: reorder the two 4-byte middles.
        const __m256i words = _mm256_packs_epi32(low, high);
        const __m128i bytes =
            _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
        const __m128i ordered = _mm_shuffle_epi32(bytes, 0xD8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q.data() + at * block + 16 * g), ordered);
        const __m256i pair_sums = _mm256_add_epi32(low, high);
        __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(pair_sums),
                                    _mm256_extracti128_si256(pair_sums, 1));
        sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4E));
        sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xB1));
        r.sums16[at * block / 16 + g] = static_cast<int16_t>(_mm_cvtsi128_si32(sum));
      }
    }
  return r;
}

// Rows of x rounded per super-block, for Q4_K, Q5_K and Q6_K (the layout flag of the VNNI
// path's operands does not apply: these dots read x in its own order).
struct SuperRows {
  RoundedRows rounded;
  int64_t blocks = 0;
  const int8_t* q(int m, int64_t b) const { return rounded.q.data() + (m * blocks + b) * kSuper; }
  float d(int m, int64_t b) const { return rounded.d[m * blocks + b]; }
  const int16_t* sums16(int m, int64_t b) const {
    return rounded.sums16.data() + (m * blocks + b) * 16;
  }
};

inline SuperRows quantize_super_rows(const bf16* x, int64_t x_stride, int rows, int64_t in,
                                     bool /*k4_order*/) {
  SuperRows r{round_rows(x, x_stride, rows, in, kSuper)};
  r.blocks = r.rounded.blocks;
  return r;
}

inline float half_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

inline float reduce_add_128(__m128 v) {
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

inline float reduce_add_256(__m256 v) {
  return reduce_add_128(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}

// 16-bit lanes shifted right by a run-time count (the loops below pass constants once
// unrolled; vpsrlw with a count register either way).
inline __m256i shift_right_16(__m256i v, int count) {
  return _mm256_srl_epi16(v, _mm_cvtsi32_si128(count));
}

// y[m] = row . x[x_first + m] for a Q4_K (kFive false) or Q5_K row of `blocks` super-blocks:
// 32 bytes of nibbles hold sub-block 2i (low) and 2i + 1 (high), each 32 weights against
// x's 32 values of that sub-block.
template <int M, bool kFive>
inline void k4_dot(const SuperRows& xq, int x_first, const uint8_t* row, float (&y)[M]) {
  constexpr int64_t kBytes = kFive ? 176 : 144;
  const __m256i nibble = _mm256_set1_epi8(0x0F), bit = _mm256_set1_epi8(0x01);
  __m256 acc[M];
  __m128 mins_acc[M];
  for (int m = 0; m < M; ++m) {
    acc[m] = _mm256_setzero_ps();
    mins_acc[m] = _mm_setzero_ps();
  }
  for (int64_t b = 0; b < xq.blocks; ++b) {
    const uint8_t* block = row + b * kBytes;
    const float d = half_float(block), dmin = half_float(block + 2);
    uint32_t u[4];
    unpack_k4_scales(block + 4, u);
    const uint8_t* scales = reinterpret_cast<const uint8_t*>(u);
    const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<__m128i*>(u + 2)));
    const uint8_t* qs = block + (kFive ? 48 : 16);
    const __m256i high_bits = kFive ? load256(block + 16) : _mm256_setzero_si256();
    __m256i dots[M];
    for (int m = 0; m < M; ++m) dots[m] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256i packed = load256(qs + 32 * i);
      for (int high = 0; high < 2; ++high) {
        const int s = 2 * i + high;
        __m256i w = _mm256_and_si256(high ? _mm256_srli_epi16(packed, 4) : packed, nibble);
        if constexpr (kFive)  // sub-block s's 5th bit is bit s of its 32 bytes
          w = _mm256_or_si256(
              w, _mm256_slli_epi16(_mm256_and_si256(shift_right_16(high_bits, s), bit), 4));
        const __m256i scale = _mm256_set1_epi16(scales[s]);
        for (int m = 0; m < M; ++m) {
          const __m256i pairs = _mm256_maddubs_epi16(w, load256(xq.q(x_first + m, b) + 32 * s));
          dots[m] = _mm256_add_epi32(dots[m], _mm256_madd_epi16(pairs, scale));
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      const float dx = xq.d(x_first + m, b);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[m]), _mm256_set1_ps(d * dx), acc[m]);
      // x's sums per 32 values: pairs of its sums per 16 (vphaddw).
      const __m128i sums16_low =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq.sums16(x_first + m, b)));
      const __m128i sums16_high =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq.sums16(x_first + m, b) + 8));
      const __m128i mins_dot = _mm_madd_epi16(mins, _mm_hadd_epi16(sums16_low, sums16_high));
      mins_acc[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(mins_dot), _mm_set1_ps(dmin * dx), mins_acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) y[m] = reduce_add_256(acc[m]) - reduce_add_128(mins_acc[m]);
}

// y[m] = row . x[x_first + m] for a Q6_K row: per half h, weights 128h + 32p + l (p 0..3)
// are ql[32 (p % 2) + l]'s low (p < 2) or high nibble with bits 2p, 2p + 1 of qh[l] above
// them, q in 0..63, w = d * sc * (q - 32), one int8 scale per 16 weights: the dots take q as
// it is and 32 * sc * sum(x) comes off after.
template <int M>
inline void q6_dot(const SuperRows& xq, int x_first, const uint8_t* row, float (&y)[M]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), two_bits = _mm256_set1_epi8(0x03);
  __m256 acc[M], offset_acc[M];
  for (int m = 0; m < M; ++m) acc[m] = offset_acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < xq.blocks; ++b) {
    const uint8_t* block = row + b * 210;
    const float d = half_float(block + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
    const __m256i scales16 =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    __m256i dots[M];
    for (int m = 0; m < M; ++m) dots[m] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i low[2] = {load256(block + 64 * h), load256(block + 64 * h + 32)};
      const __m256i high_bits = load256(block + 128 + 32 * h);
      for (int p = 0; p < 4; ++p) {
        const __m256i nibbles =
            _mm256_and_si256(p < 2 ? low[p % 2] : _mm256_srli_epi16(low[p % 2], 4), nibble);
        const __m256i top = _mm256_and_si256(shift_right_16(high_bits, 2 * p), two_bits);
        const __m256i w = _mm256_or_si256(nibbles, _mm256_slli_epi16(top, 4));
        // int16 lanes 0..7 are weights 0..15 of the 32, lanes 8..15 weights 16..31.
        const int g = 8 * h + 2 * p;
        const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
        for (int m = 0; m < M; ++m) {
          const __m256i pairs =
              _mm256_maddubs_epi16(w, load256(xq.q(x_first + m, b) + 128 * h + 32 * p));
          dots[m] = _mm256_add_epi32(dots[m], _mm256_madd_epi16(pairs, scale));
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      const float dx = xq.d(x_first + m, b);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[m]), _mm256_set1_ps(d * dx), acc[m]);
      const __m256i offset_dot = _mm256_madd_epi16(scales16, load256(xq.sums16(x_first + m, b)));
      offset_acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(offset_dot), _mm256_set1_ps(32.f * d * dx),
                                      offset_acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) y[m] = reduce_add_256(acc[m]) - reduce_add_256(offset_acc[m]);
}

// Byte j of the result 0xFF where bit j of the 32 bits at p is set (llama.cpp's
// bytes_from_bits_32): the 4 bytes spread over 8 lanes each, each lane's bit tested.
inline __m256i bytes_from_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread =
      _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                          _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                            0x0101010101010101, 0x0000000000000000));
  return _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                           _mm256_set1_epi64x(-1));
}

}  // namespace kquants

// Rows of x rounded per 32 values for the 32-weight types: vnni.h's Int8Rows fields.
struct Int8Rows {
  kquants::RoundedRows rounded;
  int64_t blocks = 0;
  std::vector<float> block_sums;  // [rows][blocks]: d * sum(q), the rounded block's sum
  const int8_t* q(int64_t at) const { return rounded.q.data() + at * 32; }
  float d(int64_t at) const { return rounded.d[at]; }
};

inline Int8Rows quantize_rows(const bf16* x, int64_t x_stride, int rows, int64_t in) {
  Int8Rows r{kquants::round_rows(x, x_stride, rows, in, 32)};
  r.blocks = r.rounded.blocks;
  r.block_sums.resize(rows * r.blocks);
  for (int64_t at = 0; at < rows * r.blocks; ++at)
    r.block_sums[at] =
        r.d(at) * static_cast<float>(r.rounded.sums16[2 * at] + r.rounded.sums16[2 * at + 1]);
  return r;
}

namespace kquants {

// The 32-weight types (ggml ids: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8) against x rounded
// per 32: each block is w = scale * u + c, so its dot with the rounded x is
// scale * d_x * (u . q_x) + c * (d_x * sum(q_x)). Q8_0's quants are signed (c = 0): they
// go in as |q| against q_x with q's sign.
template <int64_t kType>
struct Block32 {
  static constexpr int64_t kBytes = block32_bytes(kType);
  static constexpr bool kMin = block32_has_min(kType), kFifth = block32_has_fifth_bits(kType);

  // The block's quants in x's order, with its scale and constant term.
  static __m256i quants(const uint8_t* block, float& scale, float& c) {
    scale = half_float(block);
    if constexpr (kType == 8) {
      c = 0.f;
      return load256(block + 2);
    } else {
      c = kMin ? half_float(block + 2) : block32_offset_per_d(kType) * scale;
      const uint8_t* qs = block + (kMin ? 4 : 2) + (kFifth ? 4 : 0);
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
      const __m128i nibble = _mm_set1_epi8(0x0F);
      __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble),
                                   _mm_and_si128(packed, nibble));
      if constexpr (kFifth)
        u = _mm256_or_si256(
            u, _mm256_and_si256(bytes_from_bits(block + (kMin ? 4 : 2)), _mm256_set1_epi8(16)));
      return u;
    }
  }
};

// y[m] = row . x[x_first + m] for a row of `blocks` 32-weight blocks of type kType.
template <int M, int64_t kType>
inline void block32_dot(const Int8Rows& xq, int x_first, const uint8_t* row, float (&y)[M]) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[M];
  float constant[M];
  for (int m = 0; m < M; ++m) {
    acc[m] = _mm256_setzero_ps();
    constant[m] = 0.f;
  }
  for (int64_t b = 0; b < xq.blocks; ++b) {
    float scale, c;
    const __m256i u = Block32<kType>::quants(row + b * Block32<kType>::kBytes, scale, c);
    const __m256i magnitude = kType == 8 ? _mm256_sign_epi8(u, u) : u;
    for (int m = 0; m < M; ++m) {
      const int64_t at = (x_first + m) * xq.blocks + b;
      __m256i x = load256(xq.q(at));
      if constexpr (kType == 8) x = _mm256_sign_epi8(x, u);
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, x), ones);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale * xq.d(at)), acc[m]);
      constant[m] += c * xq.block_sums[at];
    }
  }
  for (int m = 0; m < M; ++m) y[m] = reduce_add_256(acc[m]) + constant[m];
}

}  // namespace kquants
}  // namespace kvscope::quantized

#endif  // KVSCOPE_AVX2_DOTS
