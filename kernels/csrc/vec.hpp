// The kernels' vector layer: 16 fp32 lanes (FP32Vec16) with the loads, stores, conversions
// and reductions the kernels share, after vLLM's csrc/cpu/cpu_types_x86.hpp.
//
// A vector is a GCC/Clang vector-extension value of 64 bytes: on an AVX-512 build that is
// one zmm register and the very type of __m512, so an intrinsic takes it as it is; elsewhere
// the compiler lowers each operation to two AVX2 registers or to scalars. Elementwise
// arithmetic is written once, with the vector operators; what needs an instruction set
// (horizontal sums, bf16 pair dots) is chosen at compile time, with a portable version
// where a kernel needs one. The build is -march=native (kernels/cpu_extension.py), so the
// branch taken is the running CPU's.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "cpu_common.h"

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace kvscope::vec {

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));

// Unaligned vector loads and stores: memcpy into a byte vector makes GCC 12 load it
// through general registers and widen it byte by byte.
template <typename Vector, typename Element>
inline Vector load_unaligned(const Element* p) {
  typedef Vector Unaligned __attribute__((aligned(1), may_alias));
  return *reinterpret_cast<const Unaligned*>(p);
}

template <typename Vector, typename Element>
inline void store_unaligned(Element* p, Vector v) {
  typedef Vector Unaligned __attribute__((aligned(1), may_alias));
  *reinterpret_cast<Unaligned*>(p) = v;
}

// 16 unsigned bytes, to be widened to fp32 lanes (FP32Vec16::widen).
struct U8Vec16 {
  u8x16 reg;

  static U8Vec16 load(const uint8_t* p) { return {load_unaligned<u8x16>(p)}; }
  void store(uint8_t* p) const { std::memcpy(p, &reg, sizeof(reg)); }
  U8Vec16 operator&(uint8_t mask) const { return {reg & mask}; }
  U8Vec16 operator|(U8Vec16 other) const { return {reg | other.reg}; }
  U8Vec16 operator>>(int shift) const { return {reg >> shift}; }
  U8Vec16 operator<<(int shift) const { return {reg << shift}; }
  U8Vec16 operator^(uint8_t bits) const { return {reg ^ bits}; }
};

// 8 fp32 lanes: one AVX2 register, or half of a FP32Vec16.
struct FP32Vec8 {
  f32x8 reg;

  // The sum of the lanes: lane i plus lane i + 4 first, then those four pairwise,
  // ((0+4) + (1+5)) + ((2+6) + (3+7)).
  float reduce_sum() const {
    return ((reg[0] + reg[4]) + (reg[1] + reg[5])) + ((reg[2] + reg[6]) + (reg[3] + reg[7]));
  }
};

struct FP32Vec16 {
  f32x16 reg;

  FP32Vec16() : reg{} {}           // zeros
  FP32Vec16(f32x16 r) : reg(r) {}  // also __m512, the same type on an AVX-512 build
  explicit FP32Vec16(float x) {
#if defined(__AVX512F__)
    reg = _mm512_set1_ps(x);
#else
    for (int i = 0; i < 16; ++i) reg[i] = x;
#endif
  }

  // 16 lanes of 16 bits zero-extended to 32, and 32-bit lanes' high halves narrowed back to
  // 16: GCC 12 splits either conversion of a 512-bit vector into 256-bit halves (five
  // instructions where one vpmovzxwd does it, a vpermi2w and a constant's load for one
  // vpmovdw), and the value pass of a decode's attention widens every value row so.
  template <typename Element>
  static u32x16 widen_u16(const Element* p) {
    static_assert(sizeof(Element) == 2);
#if defined(__AVX512F__)
    return (u32x16)_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
    return __builtin_convertvector(load_unaligned<u16x16>(p), u32x16);
#endif
  }
  // 16 bytes zero-extended to 32 bits: GCC 12 widens a byte vector's lanes one by one (even
  // through int32), where one vpmovzxbd does it.
  static u32x16 widen_u8(u8x16 bytes) {
#if defined(__AVX512F__)
    return (u32x16)_mm512_cvtepu8_epi32((__m128i)bytes);
#else
    return (u32x16) __builtin_convertvector(bytes, i32x16);
#endif
  }
  template <typename Element>
  static void store_high_halves(Element* p, u32x16 bits) {
    static_assert(sizeof(Element) == 2);
#if defined(__AVX512F__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16((__m512i)(bits >> 16)));
#else
    store_unaligned(p, __builtin_convertvector(bits >> 16, u16x16));
#endif
  }

  static FP32Vec16 load(const float* p) { return load_unaligned<f32x16>(p); }
  // bf16 bits widened: the bits shifted into the high half of each fp32 lane (exact).
  static FP32Vec16 load(const bf16* p) { return (f32x16)(widen_u16(p) << 16); }
  // float16 bits widened by rebiasing the exponent (a multiply by 2^112): exact for every
  // finite value, subnormals included.
  static FP32Vec16 load(const c10::Half* p) {
    const u32x16 bits = widen_u16(p);
    const f32x16 magnitude = (f32x16)((bits & 0x7fff) << 13) * 0x1p112f;
    return (f32x16)((u32x16)magnitude | ((bits & 0x8000) << 16));
  }
  // Quantized KV codes (kvscope::load's scalar twins, exact): int8, and fp8's magnitude bits
  // placed under fp32's exponent and mantissa, rebiased by a multiply (subnormals included).
  static FP32Vec16 load(const int8_t* p) { return widen(p); }
  static FP32Vec16 load(const fp8_e4m3* p) { return from_fp8<20>(p, 0x1p120f); }
  static FP32Vec16 load(const fp8_e5m2* p) { return from_fp8<21>(p, 0x1p112f); }
  template <int kShift>
  static FP32Vec16 from_fp8(const void* p, float rebias) {
    const u32x16 bits = widen_u8(load_unaligned<u8x16>(static_cast<const uint8_t*>(p)));
    const f32x16 magnitude = (f32x16)((bits & 0x7f) << kShift) * rebias;
    return (f32x16)((u32x16)magnitude | ((bits & 0x80) << 24));
  }
  // Unsigned bytes to fp32 through int32: GCC 12 converts bytes straight to floats one by one.
  static FP32Vec16 widen(U8Vec16 bytes) {
    return __builtin_convertvector((i32x16)widen_u8(bytes.reg), f32x16);
  }
  // Signed bytes: on AVX-512 one vpmovsxbd; elsewhere flipped to q + 128 and widened as
  // unsigned ones (GCC 12 widens signed byte vectors element by element), then the 128 comes
  // off exactly in fp32.
  static FP32Vec16 widen(const int8_t* p) {
#if defined(__AVX512F__)
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
    return widen(U8Vec16::load(reinterpret_cast<const uint8_t*>(p)) ^ 0x80).reg - 128.f;
#endif
  }

  void store(float* p) const { store_unaligned(p, reg); }
  // Rounded to nearest even (kvscope::bf16_bits for every finite value), then narrowed.
  void store(bf16* p) const {
    store_high_halves(p, (u32x16)rounded_to(static_cast<bf16*>(nullptr)).reg);
  }

  // Values bf16 holds exactly (small integers, fp8 codes) as bf16: their low bits are zero.
  void store_exact(bf16* p) const { store_high_halves(p, (u32x16)reg); }

  // The lanes rounded to T's precision, still fp32 (what storing to T and loading gives).
  FP32Vec16 rounded_to(float*) const { return *this; }
  FP32Vec16 rounded_to(bf16*) const {
    u32x16 bits = (u32x16)reg;
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (f32x16)(bits & 0xFFFF0000u);
  }

  FP32Vec16 operator+(FP32Vec16 other) const { return reg + other.reg; }
  FP32Vec16 operator-(FP32Vec16 other) const { return reg - other.reg; }
  FP32Vec16 operator*(FP32Vec16 other) const { return reg * other.reg; }
  FP32Vec16 operator*(float x) const { return reg * x; }  // x broadcast in the operation
  FP32Vec16& operator+=(FP32Vec16 other) {
    reg += other.reg;
    return *this;
  }

  static FP32Vec16 max(FP32Vec16 a, FP32Vec16 b) { return a.reg > b.reg ? a.reg : b.reg; }
  float reduce_max() const {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps(reg);
#else
    float top = reg[0];
    for (int i = 1; i < 16; ++i) top = reg[i] > top ? reg[i] : top;
    return top;
#endif
  }

  // Lanes 0..7 plus lanes 8..15.
  FP32Vec8 add_halves() const {
    f32x8 low, high;
    std::memcpy(&low, &reg, sizeof(low));
    std::memcpy(&high, reinterpret_cast<const char*>(&reg) + sizeof(low), sizeof(high));
    return {low + high};
  }

  // The sum of the lanes: halves added pairwise (upper 8 + lower 8, then 4 + 4, then
  // [0]+[2] and [1]+[3], then those two), the order of AVX-512's reduce_add everywhere.
  float reduce_sum() const {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps(reg);
#else
    float eight[8], four[4];
    for (int i = 0; i < 8; ++i) eight[i] = reg[i + 8] + reg[i];
    for (int i = 0; i < 4; ++i) four[i] = eight[i + 4] + eight[i];
    return (four[0] + four[2]) + (four[1] + four[3]);
#endif
  }
};

// kvscope::exp_nonpositive lane by lane, the same steps.
inline FP32Vec16 exp_nonpositive(FP32Vec16 x) {
  const f32x16 lowest = f32x16{} - 87.f;
  const f32x16 t = (x.reg > lowest ? x.reg : lowest) * 1.44269504088896341f;
  const f32x16 n = (t + 12582912.f) - 12582912.f;
  const i32x16 exponent = (__builtin_convertvector(n, i32x16) + 127) << 23;
  return exp2_of_fraction(t - n) * (f32x16)exponent;
}

// table[codes[i] & 15] in lane i: 16 entries of a 16-value table picked by 4-bit codes (an
// MXFP4 group's values), one vpermps on AVX-512.
inline FP32Vec16 lookup16(FP32Vec16 table, u32x16 codes) {
#if defined(__AVX512F__)
  return _mm512_permutexvar_ps((__m512i)(codes & 15u), table.reg);
#else
  FP32Vec16 picked;
  for (int i = 0; i < 16; ++i) picked.reg[i] = table.reg[codes[i] & 15u];
  return picked;
#endif
}

// a * b + c with a single rounding where the CPU has FMA (vfmadd), else two. Kernels write
// their multiply-adds with it rather than leave them to the compiler's contraction, which in
// `a * b + c * d` fuses whichever product it meets first: the rounding would then hang on
// how an expression happens to be written.
inline FP32Vec16 fma(FP32Vec16 a, FP32Vec16 b, FP32Vec16 c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a.reg, b.reg, c.reg);
#elif defined(__FMA__)
  __m256 x[2], y[2], z[2];
  std::memcpy(x, &a.reg, sizeof(x));
  std::memcpy(y, &b.reg, sizeof(y));
  std::memcpy(z, &c.reg, sizeof(z));
  for (int i = 0; i < 2; ++i) z[i] = _mm256_fmadd_ps(x[i], y[i], z[i]);
  f32x16 sum;
  std::memcpy(&sum, z, sizeof(sum));
  return sum;
#else
  return a.reg * b.reg + c.reg;
#endif
}

// The lane sums of 16 vectors as one vector: lane i of the result is the sum of partial[i]'s
// lanes (16 scores, or 16 output rows). On AVX-512 each level adds pairs of vectors after
// interleaving them, halving the count: 45 shuffles and adds for all 16, against ~8 ops and a
// ~20-cycle chain for a horizontal sum of each on its own.
inline FP32Vec16 reduce_sum_16(const FP32Vec16 (&partial)[16]) {
#if defined(__AVX512F__)
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(partial[2 * i].reg, partial[2 * i + 1].reg),
                             _mm512_unpackhi_ps(partial[2 * i].reg, partial[2 * i + 1].reg));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: [a, b, c, d], each that lane's share
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // lanes [v(L0+L1), v(L2+L3), w(L0+L1), w(L2+L3)]
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
#else
  FP32Vec16 sums;
  for (int i = 0; i < 16; ++i) sums.reg[i] = partial[i].reduce_sum();
  return sums;
#endif
}

// Rows rows of x (row stride x_stride) . w over `size` elements, into sums[0..Rows). Each
// 32 weights are widened once and multiplied into every row while they sit in registers:
// widening them again per row made each extra row of a verification cost a quarter of a
// decode (dense_linear.cpp). Two accumulators per row: one would chain every FMA on the previous
// one, and that latency, not memory, would bound the weight stream. A row's sum takes the same
// steps in the same order whatever Rows is, so each row of a short chunk (a speculative
// verification) gets bit for bit what its decode alone gets.
template <int Rows, typename T>
inline void dot_rows(const float* __restrict x, int64_t x_stride, const T* __restrict w,
                     int64_t size, float* __restrict sums) {
  FP32Vec16 partial[Rows][2];
  for (auto& row : partial) row[0] = row[1] = FP32Vec16(0.f);
  int64_t k = 0;
  for (; k + 32 <= size; k += 32) {
    const FP32Vec16 low = FP32Vec16::load(w + k), high = FP32Vec16::load(w + k + 16);
    for (int m = 0; m < Rows; ++m) {
      const float* row = x + m * x_stride + k;
      partial[m][0] = fma(FP32Vec16::load(row), low, partial[m][0]);
      partial[m][1] = fma(FP32Vec16::load(row + 16), high, partial[m][1]);
    }
  }
  for (int m = 0; m < Rows; ++m) {
    float sum = (partial[m][0] + partial[m][1]).reduce_sum();
    for (int64_t tail = k; tail < size; ++tail) sum += x[m * x_stride + tail] * load(w[tail]);
    sums[m] = sum;
  }
}

#if defined(__AVX512BF16__)
// 32 bf16 values as the pairs vdpbf16ps multiplies.
struct BF16Vec32 {
  __m512bh reg;

  static BF16Vec32 load(const bf16* p) { return {(__m512bh)_mm512_loadu_si512(p)}; }
  // The first `count` (< 32) values, zeros after them.
  static BF16Vec32 load_first(const bf16* p, int64_t count) {
    return {(__m512bh)_mm512_maskz_loadu_epi16((1u << count) - 1u, p)};
  }
  void store(bf16* p) const { _mm512_storeu_si512(p, (__m512i)reg); }
  // a's and b's values i side by side as pair i: values 0-15 into `low`, 16-31 into `high`.
  static void interleave(BF16Vec32 a, BF16Vec32 b, BF16Vec32& low, BF16Vec32& high) {
    alignas(64) static constexpr uint16_t kLow[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                      37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                      11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i first = _mm512_load_si512(kLow),
                  second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    low.reg = (__m512bh)_mm512_permutex2var_epi16((__m512i)a.reg, first, (__m512i)b.reg);
    high.reg = (__m512bh)_mm512_permutex2var_epi16((__m512i)a.reg, second, (__m512i)b.reg);
  }
  // The pair p[0], p[1] in each of the 16 pair slots: one input pair against 16 weight pairs.
  static BF16Vec32 broadcast_pair(const bf16* p) {
    int32_t pair;
    std::memcpy(&pair, p, sizeof(pair));
    return {(__m512bh)_mm512_set1_epi32(pair)};
  }
};

// out[c * out_stride + r] = rows[r][c] for a 16 x 16 block of 32-bit values (two bf16
// values, a pair, move as one; a null row reads as zeros), transposed in registers in four
// rounds of shuffles.
inline void transpose_16x16(const uint32_t* const (&from)[16], uint32_t* out, int64_t out_stride) {
  __m512i rows[16], t[16];
  for (int i = 0; i < 16; ++i)
    rows[i] = from[i] != nullptr ? _mm512_loadu_si512(from[i]) : _mm512_setzero_si512();
  for (int i = 0; i < 16; i += 2) {  // lane j of t[i], t[i + 1]: rows i, i + 1 interleaved
    t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // lane j of rows[i + k]: column 4j + k of rows i..i+3
    rows[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    rows[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    rows[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    rows[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)  // rows i..i+7: even lanes, then odd lanes
    for (int k = 0; k < 4; ++k) {
      t[i + k] = _mm512_shuffle_i32x4(rows[i + k], rows[i + 4 + k], 0x88);
      t[i + 4 + k] = _mm512_shuffle_i32x4(rows[i + k], rows[i + 4 + k], 0xdd);
    }
  for (int k = 0; k < 8; ++k) {  // columns k (lanes 0 and 2) and k + 8 (lanes 1 and 3)
    _mm512_storeu_si512(out + k * out_stride, _mm512_shuffle_i32x4(t[k], t[k + 8], 0x88));
    _mm512_storeu_si512(out + (k + 8) * out_stride, _mm512_shuffle_i32x4(t[k], t[k + 8], 0xdd));
  }
}

// acc + the products of a's and b's pairs, summed pair by pair into acc's 16 lanes: the
// products are exact in fp32, so only the order of the fp32 sums differs from widening both.
inline FP32Vec16 dot_accumulate(FP32Vec16 acc, BF16Vec32 a, BF16Vec32 b) {
  return _mm512_dpbf16_ps(acc.reg, a.reg, b.reg);
}
#endif

}  // namespace kvscope::vec
