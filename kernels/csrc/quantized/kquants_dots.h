// The int8-dot path of gguf_linear for bf16 activations, after llama.cpp's dots, on a CPU with
// AVX512-VNNI or with AVX2 alone (Zen 3, Haswell to Alder Lake). Each row of x is rounded to
// int8 once per call, one scale per 256 values for the k-quants (llama.cpp's q8_K, whose
// super-blocks are the weights') and per 32 for Q4_0..Q8_0 (Q8_0). Per 32 weights, vpmaddubsw
// multiplies the unsigned quants by x's int8 into int16 pairs, and those pairs times the
// sub-block's integer scale (or 1) are summed into int32, exact: a k-quant super-block's dot is
// one integer sum, scaled once by d * d_x in fp32. The k-quants' pairs cannot saturate int16:
// the largest quant is 63 (Q6_K); Q8_0's bytes take a path of their own (Isa::dot32). The mins
// (Q4_K, Q5_K), Q6_K's offset of 32 and the 32-weight types' constants meet x's sums per 16 or
// 32 values. That rounding of the activations is the one approximation
// (tests/test_gguf_blocks.py holds the kernel to the rounded x's exact product).
//
// One body serves both instruction sets: `Isa` is the build's (Avx512Vnni or Avx2), a vector
// width and the few instructions that differ between them. A 64-byte vector of nibbles holds
// two runs of 32 weights, one per 256-bit half, so each step of the body takes a sub-block per
// half (kHalves of them) where a 32-byte vector takes one.
#pragma once

#include "quantized/kquants_blocks.h"
#include "quantized/vnni.h"

#if !defined(KVSCOPE_VNNI_DOTS) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVSCOPE_AVX2_DOTS 1
#endif

#if defined(KVSCOPE_VNNI_DOTS) || defined(KVSCOPE_AVX2_DOTS)
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace kvscope::quantized::kquants {

constexpr int64_t kSuper = 256;  // weights per k-quant super-block, x values per scale

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

#if defined(KVSCOPE_VNNI_DOTS)
// 32 int16 lanes: lanes 0..15 `first`, lanes 16..31 `second` (a per-half index or shift).
inline __m512i halves_epi16(int16_t first, int16_t second) {
  return _mm512_inserti64x4(_mm512_set1_epi16(first), _mm256_set1_epi16(second), 1);
}

// 512-bit vectors; vpdpwssd adds the pairs times the scales in one instruction, vpdpbusd a
// 32-weight block's whole dot, and vpermw picks each half's scale from a register.
struct Avx512Vnni {
  using Bytes = __m512i;
  using Floats = __m512;
  static constexpr int kWidth = 64;  // bytes per vector

  static Bytes load(const void* p) { return _mm512_loadu_si512(p); }
  static Bytes load_to_halves(const void* p) {  // 32 bytes into each half
    return _mm512_broadcast_i64x4(load256(p));
  }
  static Bytes splat(char byte) { return _mm512_set1_epi8(byte); }
  static Bytes shift_right_16(Bytes v, int count) { return _mm512_srli_epi16(v, count); }
  static Bytes shift_left_16(Bytes v, int count) { return _mm512_slli_epi16(v, count); }
  // Half h's 16-bit lanes shifted right by first + 2h.
  static Bytes shift_halves_right(Bytes v, int first) {
    return _mm512_srlv_epi16(v, halves_epi16(first, first + 2));
  }
  static Bytes multiply_pairs(Bytes w, Bytes x) { return _mm512_maddubs_epi16(w, x); }
  static Bytes add_scaled_pairs(Bytes sums, Bytes pairs, Bytes scales) {
    return _mm512_dpwssd_epi32(sums, pairs, scales);
  }
  static Floats add_scaled(Floats acc, Bytes sums, float scale) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(scale), acc);
  }
  static float reduce_add(Floats v) { return _mm512_reduce_add_ps(v); }

  // Q4_K / Q5_K's 8 sub-block scales (bytes 0..7 of the unpacked scales): at(first) is
  // sub-block first's scale in every 16-bit lane of half 0, first + 2's in half 1.
  struct K4Scales {
    __m512i scales;
    explicit K4Scales(const uint32_t (&u)[4])
        : scales(_mm512_castsi256_si512(
              _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u))))) {}
    Bytes at(int first) const {
      return _mm512_permutexvar_epi16(halves_epi16(first, first + 2), scales);
    }
  };
  // Q6_K's 16 int8 scales: at(first) is scale first + t in every 16-bit lane of 128-bit lane
  // t (16 weights each).
  struct Q6Scales {
    __m512i scales;
    explicit Q6Scales(const int8_t* bytes)
        : scales(_mm512_castsi256_si512(
              _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))))) {}
    Bytes at(int first) const {
      const __m512i lane_of =
          _mm512_set_epi64(0x0003000300030003, 0x0003000300030003, 0x0002000200020002,
                           0x0002000200020002, 0x0001000100010001, 0x0001000100010001, 0, 0);
      return _mm512_permutexvar_epi16(_mm512_add_epi16(lane_of, _mm512_set1_epi16(first)), scales);
    }
  };

  // 16 bf16 values of x as fp32; their codes rounded, stored (16 int8) and summed.
  using Sixteen = __m512;
  static Sixteen load_sixteen(const bf16* p) { return load_bf16x16(p, 0xFFFF); }
  static Sixteen max_abs(Sixteen amax, Sixteen v) { return _mm512_max_ps(amax, _mm512_abs_ps(v)); }
  static float reduce_max(Sixteen v) { return _mm512_reduce_max_ps(v); }
  static int round_sixteen(Sixteen v, __m512 inverse, int8_t* out) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(q));
    return _mm512_reduce_add_epi32(q);
  }
  static __m512 splat_float(float value) { return _mm512_set1_ps(value); }

  // Q8_0's quants flipped to unsigned (q + 128), the -128 * d going to the block's constant.
  static __m256i q8_quants(const uint8_t* qs, float scale, float& c) {
    c = block32_offset_per_d(8) * scale;
    return _mm256_xor_si256(load256(qs), _mm256_set1_epi8(-128));
  }
  // 16 where bit j of the 32 bits at p is set, in byte j.
  static __m256i fifth_bits(const uint8_t* p) {
    uint32_t bits;
    std::memcpy(&bits, p, 4);
    return _mm256_maskz_mov_epi8(_cvtu32_mask32(bits), _mm256_set1_epi8(16));
  }
  // u . x per 4 bytes into int32 lanes; Q8_0's flipped quants (kQ8) are unsigned like the rest.
  template <bool kQ8>
  static __m256i dot32(__m256i u, __m256i x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
  }
};
using Isa = Avx512Vnni;
#else
inline __m256 load_bf16x8(const bf16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// 256-bit vectors, without vpdpwssd / vpdpbusd: vpmaddwd sums the pairs times the scales and
// vpaddd adds them up.
struct Avx2 {
  using Bytes = __m256i;
  using Floats = __m256;
  static constexpr int kWidth = 32;  // bytes per vector

  static Bytes load(const void* p) { return load256(p); }
  static Bytes load_to_halves(const void* p) { return load256(p); }  // one half
  static Bytes splat(char byte) { return _mm256_set1_epi8(byte); }
  static Bytes shift_right_16(Bytes v, int count) { return _mm256_srli_epi16(v, count); }
  static Bytes shift_left_16(Bytes v, int count) { return _mm256_slli_epi16(v, count); }
  static Bytes shift_halves_right(Bytes v, int first) {
    return _mm256_srl_epi16(v, _mm_cvtsi32_si128(first));
  }
  static Bytes multiply_pairs(Bytes w, Bytes x) { return _mm256_maddubs_epi16(w, x); }
  static Bytes add_scaled_pairs(Bytes sums, Bytes pairs, Bytes scales) {
    return _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, scales));
  }
  static Floats add_scaled(Floats acc, Bytes sums, float scale) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(scale), acc);
  }
  static float reduce_add(Floats v) { return reduce_add_256(v); }

  // As Avx512Vnni's, for the one half.
  struct K4Scales {
    const uint8_t* scales;
    explicit K4Scales(const uint32_t (&u)[4]) : scales(reinterpret_cast<const uint8_t*>(u)) {}
    Bytes at(int first) const { return _mm256_set1_epi16(scales[first]); }
  };
  struct Q6Scales {
    const int8_t* scales;
    explicit Q6Scales(const int8_t* bytes) : scales(bytes) {}
    Bytes at(int first) const {
      return _mm256_set_m128i(_mm_set1_epi16(scales[first + 1]), _mm_set1_epi16(scales[first]));
    }
  };

  struct Sixteen {
    __m256 low, high;
  };
  static Sixteen load_sixteen(const bf16* p) { return {load_bf16x8(p), load_bf16x8(p + 8)}; }
  static Sixteen max_abs(Sixteen amax, Sixteen v) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    return {_mm256_max_ps(amax.low, _mm256_andnot_ps(sign, v.low)),
            _mm256_max_ps(amax.high, _mm256_andnot_ps(sign, v.high))};
  }
  static float reduce_max(Sixteen v) {
    const __m256 both = _mm256_max_ps(v.low, v.high);
    __m128 max4 = _mm_max_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
    max4 = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
    return _mm_cvtss_f32(_mm_max_ss(max4, _mm_movehdup_ps(max4)));
  }
  static int round_sixteen(Sixteen v, __m256 inverse, int8_t* out) {
    // vcvtps2dq rounds to nearest, ties to even (the MXCSR default), as on VNNI.
    const __m256i low = _mm256_cvtps_epi32(_mm256_mul_ps(v.low, inverse));
    const __m256i high = _mm256_cvtps_epi32(_mm256_mul_ps(v.high, inverse));
    // int32 to int8, saturating; the packs interleave 128-bit lanes, so the bytes come
    // out as low[0..3] high[0..3] low[4..7] high[4..7]: reorder the two 4-byte middles.
    const __m256i words = _mm256_packs_epi32(low, high);
    const __m128i bytes =
        _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_shuffle_epi32(bytes, 0xD8));
    const __m256i pair_sums = _mm256_add_epi32(low, high);
    __m128i sum =
        _mm_add_epi32(_mm256_castsi256_si128(pair_sums), _mm256_extracti128_si256(pair_sums, 1));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4E));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xB1));
    return _mm_cvtsi128_si32(sum);
  }
  static __m256 splat_float(float value) { return _mm256_set1_ps(value); }

  // Q8_0's quants as they are (signed): dot32 takes their magnitudes against x carrying their
  // signs (vpsignb), whose products fit vpmaddubsw's int16 pairs (128 * 127 * 2 at most).
  static __m256i q8_quants(const uint8_t* qs, float /*scale*/, float& c) {
    c = 0.f;
    return load256(qs);
  }
  // 16 where bit j of the 32 bits at p is set, in byte j (after llama.cpp's
  // bytes_from_bits_32): the 4 bytes spread over 8 lanes each, each lane's bit tested.
  static __m256i fifth_bits(const uint8_t* p) {
    uint32_t bits;
    std::memcpy(&bits, p, 4);
    const __m256i spread =
        _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                            _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                              0x0101010101010101, 0x0000000000000000));
    const __m256i set = _mm256_cmpeq_epi8(
        _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
  }
  // u . x per 4 bytes into int32 lanes (pairs by vpmaddubsw, then pairs of pairs); kQ8: u is
  // q8_quants' (signed).
  template <bool kQ8>
  static __m256i dot32(__m256i u, __m256i x) {
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (kQ8)
      return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(x, u)),
                               ones);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones);
  }
};
using Isa = Avx2;
#endif

constexpr int kHalves = Isa::kWidth / 32;  // runs of 32 weights (sub-blocks) per vector

// `kGroups` x 16 values of x rounded: d = max|x| / 127 and q = round(x * (1 / d)), ties to
// even; group g's codes go to out(g) and their sum to sums16[g]. Returns d.
template <int kGroups, typename Out>
inline float round_block(const bf16* values, Out out, int16_t* sums16) {
  Isa::Sixteen v[kGroups], amax{};
  for (int g = 0; g < kGroups; ++g) {
    v[g] = Isa::load_sixteen(values + 16 * g);
    amax = Isa::max_abs(amax, v[g]);
  }
  const float d = Isa::reduce_max(amax) / 127.f;
  const auto inverse = Isa::splat_float(d > 0.f ? 1.f / d : 0.f);
  for (int g = 0; g < kGroups; ++g)
    sums16[g] = static_cast<int16_t>(Isa::round_sixteen(v[g], inverse, out(g)));
  return d;
}

// Where x's 32-value sub-block s of a super-block sits for Q4_K / Q5_K: a vector of nibbles
// holds kHalves runs of 32 bytes (64 weights each, low nibbles the first 32), so its low
// nibbles are one sub-block per half and its high ones the next; x is laid out as those
// operands, in the order the dots read them. Q6_K's operands are x's own order.
inline int64_t k4_position(int s) {
  return (2 * (s / (2 * kHalves)) + s % 2) * Isa::kWidth + (s / 2) % kHalves * 32;
}

// Rows of bf16 x rounded per super-block, and the sums of q per 16 and per 32 values (x's
// order).
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
      const int64_t at = m * r.blocks + b;
      int8_t* q = r.q.data() + at * kSuper;
      r.d[at] = round_block<16>(x + m * x_stride + b * kSuper, [&](int g) {
        return q + (k4_order ? k4_position(g / 2) + g % 2 * 16 : 16 * g);
      }, r.sums16.data() + at * 16);
      for (int s = 0; s < 8; ++s)
        r.sums32[at * 8 + s] = r.sums16[at * 16 + 2 * s] + r.sums16[at * 16 + 2 * s + 1];
    }
  return r;
}

// A vector of x's codes of super-block `at` (a row's block), `offset` bytes into it.
inline Isa::Bytes x_codes(const SuperRows& xq, int64_t at, int offset) {
  return Isa::load(xq.q.data() + at * kSuper + offset);
}

// y[m] = row . x[x_first + m] for a Q4_K (kFive false) or Q5_K row of `blocks` super-blocks:
// 32 bytes of nibbles hold sub-block 2c (low) and 2c + 1 (high) of 32 weights each.
template <int M, bool kFive>
inline void k4_dot(const SuperRows& xq, int x_first, const uint8_t* row, float (&y)[M]) {
  constexpr int64_t kBytes = kFive ? 176 : 144;
  const Isa::Bytes nibble = Isa::splat(0x0F), bit = Isa::splat(0x01);
  Isa::Floats acc[M];
  __m128 mins_acc[M];
  for (int m = 0; m < M; ++m) {
    acc[m] = Isa::Floats{};
    mins_acc[m] = _mm_setzero_ps();
  }
  for (int64_t b = 0; b < xq.blocks; ++b) {
    const uint8_t* block = row + b * kBytes;
    const float d = half_float(block), dmin = half_float(block + 2);
    uint32_t u[4];
    unpack_k4_scales(block + 4, u);
    const Isa::K4Scales scales(u);
    const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<__m128i*>(u + 2)));
    const uint8_t* qs = block + (kFive ? 48 : 16);
    const Isa::Bytes high_bits = kFive ? Isa::load_to_halves(block + 16) : Isa::Bytes{};
    Isa::Bytes dots[M];
    for (int m = 0; m < M; ++m) dots[m] = Isa::Bytes{};
    for (int i = 0; i < 128 / Isa::kWidth; ++i) {
      const Isa::Bytes packed = Isa::load(qs + Isa::kWidth * i);
      for (int high = 0; high < 2; ++high) {
        const int o = 2 * i + high;                // x's operand
        const int first = 2 * kHalves * i + high;  // half h's sub-block: first + 2h
        Isa::Bytes w = (high ? Isa::shift_right_16(packed, 4) : packed) & nibble;
        if constexpr (kFive)  // sub-block s's 5th bit is bit s of its 32 bytes
          w |= Isa::shift_left_16(Isa::shift_halves_right(high_bits, first) & bit, 4);
        const Isa::Bytes scale = scales.at(first);
        for (int m = 0; m < M; ++m) {
          const Isa::Bytes pairs =
              Isa::multiply_pairs(w, x_codes(xq, (x_first + m) * xq.blocks + b, Isa::kWidth * o));
          dots[m] = Isa::add_scaled_pairs(dots[m], pairs, scale);
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      const int64_t at = (x_first + m) * xq.blocks + b;
      const float dx = xq.d[at];
      acc[m] = Isa::add_scaled(acc[m], dots[m], d * dx);
      const __m128i mins_dot = _mm_madd_epi16(
          mins, _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq.sums32.data() + at * 8)));
      mins_acc[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(mins_dot), _mm_set1_ps(dmin * dx), mins_acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) y[m] = Isa::reduce_add(acc[m]) - reduce_add_128(mins_acc[m]);
}

// y[m] = row . x[x_first + m] for a Q6_K row: per half h, weights 128h + 32p + l (p 0..3)
// are ql[32 (p % 2) + l]'s low (p < 2) or high nibble with bits 2p, 2p + 1 of qh[l] above
// them, q in 0..63, w = d * sc * (q - 32), one int8 scale per 16 weights: the dots take q as
// it is and 32 * sc * sum(x) comes off after.
template <int M>
inline void q6_dot(const SuperRows& xq, int x_first, const uint8_t* row, float (&y)[M]) {
  const Isa::Bytes nibble = Isa::splat(0x0F), two_bits = Isa::splat(0x03);
  Isa::Floats acc[M];
  __m256 offset_acc[M];
  for (int m = 0; m < M; ++m) {
    acc[m] = Isa::Floats{};
    offset_acc[m] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < xq.blocks; ++b) {
    const uint8_t* block = row + b * 210;
    const float d = half_float(block + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
    const __m256i scales16 =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    const Isa::Q6Scales scales(sc);
    Isa::Bytes dots[M];
    for (int m = 0; m < M; ++m) dots[m] = Isa::Bytes{};
    for (int h = 0; h < 2; ++h) {
      Isa::Bytes low[64 / Isa::kWidth];
      for (int j = 0; j < 64 / Isa::kWidth; ++j)
        low[j] = Isa::load(block + 64 * h + Isa::kWidth * j);
      const Isa::Bytes high_bits = Isa::load_to_halves(block + 128 + 32 * h);
      for (int upper = 0; upper < 2; ++upper)
        for (int j = 0; j < 64 / Isa::kWidth; ++j) {
          const int p = 2 * upper + kHalves * j;  // half k's weights: 32 (p + k)..
          const Isa::Bytes nibbles = (upper ? Isa::shift_right_16(low[j], 4) : low[j]) & nibble;
          const Isa::Bytes top = Isa::shift_halves_right(high_bits, 2 * p) & two_bits;
          const Isa::Bytes w = nibbles | Isa::shift_left_16(top, 4);
          const Isa::Bytes scale = scales.at(8 * h + 2 * p);
          for (int m = 0; m < M; ++m) {
            const Isa::Bytes pairs = Isa::multiply_pairs(
                w, x_codes(xq, (x_first + m) * xq.blocks + b, 128 * h + 32 * p));
            dots[m] = Isa::add_scaled_pairs(dots[m], pairs, scale);
          }
        }
    }
    for (int m = 0; m < M; ++m) {
      const int64_t at = (x_first + m) * xq.blocks + b;
      const float dx = xq.d[at];
      acc[m] = Isa::add_scaled(acc[m], dots[m], d * dx);
      const __m256i offset_dot = _mm256_madd_epi16(scales16, load256(xq.sums16.data() + at * 16));
      offset_acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(offset_dot), _mm256_set1_ps(32.f * d * dx),
                                      offset_acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) y[m] = Isa::reduce_add(acc[m]) - reduce_add_256(offset_acc[m]);
}

}  // namespace kvscope::quantized::kquants

namespace kvscope::quantized {

#if defined(KVSCOPE_AVX2_DOTS)
// x rounded per 32 values for the 32-weight types, as vnni.h rounds it on VNNI.
inline Int8Rows quantize_rows(const bf16* x, int64_t x_stride, int rows, int64_t in) {
  Int8Rows r;
  r.blocks = in / kBlock;
  r.q.assign(rows * in, 0);
  r.scales.assign(rows * r.blocks, 0.f);
  r.block_sums.assign(rows * r.blocks, 0.f);
  r.scaled_q_sums.assign(rows, 0.f);
  for (int m = 0; m < rows; ++m)
    for (int64_t b = 0; b < r.blocks; ++b) {
      const int64_t at = m * r.blocks + b;
      int8_t* q = r.q.data() + at * kBlock;
      int16_t sums16[2];
      const float d = kquants::round_block<2>(x + m * x_stride + b * kBlock,
                                              [&](int g) { return q + 16 * g; }, sums16);
      r.scales[at] = d;
      r.block_sums[at] = d * static_cast<float>(sums16[0] + sums16[1]);
      r.scaled_q_sums[m] += r.block_sums[at];
    }
  return r;
}
#endif

namespace kquants {

// The 32-weight types (ggml ids: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8) against x rounded
// per 32 values (Int8Rows, llama.cpp's Q8_0): each block is w = scale * u + c with unsigned
// quants u (Q8_0's as Isa::q8_quants gives them), so its dot with the rounded x is
// scale * d_x * (u . q_x) + c * (d_x * sum(q_x)).
template <int64_t kType>
struct Block32 {
  static constexpr int64_t kBytes = block32_bytes(kType);
  static constexpr bool kMin = block32_has_min(kType), kFifth = block32_has_fifth_bits(kType);

  // The block's quants in x's order, with its scale and constant term.
  static __m256i quants(const uint8_t* block, float& scale, float& c) {
    scale = half_float(block);
    if constexpr (kType == 8) {
      return Isa::q8_quants(block + 2, scale, c);
    } else {
      c = kMin ? half_float(block + 2) : block32_offset_per_d(kType) * scale;
      const uint8_t* qs = block + (kMin ? 4 : 2) + (kFifth ? 4 : 0);
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
      const __m128i nibble = _mm_set1_epi8(0x0F);
      __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble),
                                   _mm_and_si128(packed, nibble));
      if constexpr (kFifth) u = _mm256_or_si256(u, Isa::fifth_bits(block + (kMin ? 4 : 2)));
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
      const __m256i dot = Isa::dot32<kType == 8>(u, load256(xq.q.data() + at * kBlock));
      acc[m] =
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale * xq.scales[at]), acc[m]);
      constant[m] += c * xq.block_sums[at];
    }
  }
  for (int m = 0; m < M; ++m) y[m] = reduce_add_256(acc[m]) + constant[m];
}

}  // namespace kquants
}  // namespace kvscope::quantized

#endif  // KVSCOPE_VNNI_DOTS || KVSCOPE_AVX2_DOTS
