// Linears over weight-only quantized weights (engine/models/quantized.py) for a few rows of
// activations: a single stream's decode reads every weight once per token, so these
// kernels stream the packed bytes once, de-quantize them in registers and dot them with
// every row of x while they are there. Many rows are compute-bound instead: those
// de-quantize the weight (int4_dequantize) and run a GEMM.
//
// int4: byte j of each 16-byte chunk holds weight j (low nibble) and weight j + 16 (high
// nibble) of 32 consecutive inputs (GGUF's Q4 order); weight = q * scale + offset with an
// fp16 scale and offset per group of inputs (Q4_0 / Q4_1 blocks copy in exactly).
// int8: one int8 per weight, weight = q * scale with one fp32 scale per output row.
//
// bf16 activations on a CPU with AVX512-VNNI (Zen 4, Ice Lake and later) take llama.cpp's
// route: each row of x is rounded to int8 once per call, with one scale per 32 values (Q8_0),
// and vpdpbusd multiplies 64 raw weight bytes by 64 of those per instruction, summing into
// int32; only the block sums are scaled in fp32. That rounding of the activations is the one
// approximation (tests/test_quantization.py bounds it). fp32 activations, and CPUs without
// VNNI, keep the exact path: weights widened to fp32 (GCC vector extensions, any CPU).
#include <ATen/core/Tensor.h>
#include "work_pool.h"
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_common.h"

// The build is -march=native (kernels/cpu_extension.py, cached per CPU), so these are the
// running CPU's own features; elsewhere the portable path compiles alone.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVSCOPE_VNNI_DOTS 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using kvscope::bf16;
using kvscope::elements;
using kvscope::load;
using kvscope::store;

constexpr int kMaxRows = 8;     // rows of x dotted with each weight while it is loaded
constexpr int64_t kChunk = 32;  // int4 weights in one 16-byte chunk
// Fewest weight bytes one chunk of work streams: every layer of a small model splits across
// the threads, as the dense one-row kernel's (64 rows of bf16 weights, ~72 KB for a 576-wide
// layer) do. kvscope::parallel_for lets the caller take every chunk no helper has started,
// so a descheduled helper no longer stalls a layer (the 4 MB gate this replaces was set
// when at::parallel_for did).
constexpr int64_t kBytesPerTask = 64 << 10;

int64_t grain(int64_t row_bytes) { return std::max<int64_t>(1, kBytesPerTask / row_bytes); }

// GCC/Clang vector extensions rather than intrinsics: 16 fp32 lanes are one AVX-512
// register (two AVX2 ones), and the file still builds for any CPU -march=native names.
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

// Unaligned vector loads and stores: memcpy into a byte vector makes GCC 12 load it
// through general registers and widen it byte by byte.
template <typename Vector, typename Element>
inline Vector load_vector(const Element* p) {
  typedef Vector Unaligned __attribute__((aligned(1), may_alias));
  return *reinterpret_cast<const Unaligned*>(p);
}

template <typename Vector, typename Element>
inline void store_vector(Element* p, Vector v) {
  typedef Vector Unaligned __attribute__((aligned(1), may_alias));
  *reinterpret_cast<Unaligned*>(p) = v;
}

inline f32x16 load16(const float* p) { return load_vector<f32x16>(p); }

// Unsigned bytes to fp32 lanes through int32: GCC 12 converts bytes straight to floats one
// by one.
template <typename Bytes>
inline f32x16 widen16(Bytes bytes) {
  return __builtin_convertvector(__builtin_convertvector(bytes, i32x16), f32x16);
}

// Signed bytes flipped to q + 128 widen as unsigned ones (one instruction; GCC 12 widens
// signed byte vectors element by element), then the 128 comes off exactly in fp32.
inline f32x16 widen_signed16(const int8_t* p) {
  return widen16(load_vector<u8x16>(p) ^ 0x80) - 128.f;
}

// Trees of halves: a chain of 16 scalar adds would cost as much as a short row's dots.
inline float sum_lanes(f32x8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

inline float sum_lanes(f32x16 v) {
  f32x8 low, high;
  std::memcpy(&low, &v, sizeof(low));
  std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof(low), sizeof(high));
  return sum_lanes(low + high);
}

// Rows of x widened to fp32 once per call, [rows, in].
template <typename T>
std::vector<float> widen(const T* x, int64_t x_stride, int64_t rows, int64_t in) {
  std::vector<float> xf(rows * in);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t k = 0; k < in; ++k) xf[m * in + k] = load(x[m * x_stride + k]);
  return xf;
}

// Outputs are computed for blocks of 16 consecutive output rows: the block's scales and
// offsets widen in whole vectors, and its outputs (+ bias) are stored as vectors too.
constexpr int64_t kRowBlock = 16;

inline void store16(float* p, f32x16 v) { store_vector(p, v); }

// Round to nearest even, as kvscope::bf16_bits does for every finite value.
inline void store16(bf16* p, f32x16 v) {
  u32x16 bits = (u32x16)v;
  bits += 0x7FFF + ((bits >> 16) & 1);
  store_vector(p, __builtin_convertvector(bits >> 16, u16x16));
}

inline f32x16 load16(const bf16* p) {
  return (f32x16)(__builtin_convertvector(load_vector<u16x16>(p), u32x16) << 16);
}

// out[m, first + i] = y[m][i] + bias[first + i] for the `count` rows of one block.
template <int M, typename T>
void store_block(T* out, int64_t out_stride, int64_t first, int64_t count,
                 const float (&y)[M][kRowBlock], const T* bias) {
  for (int m = 0; m < M; ++m) {
    T* row = out + m * out_stride + first;
    if (count == kRowBlock) {
      const f32x16 b = bias != nullptr ? load16(bias + first) : f32x16{};
      store16(row, load16(y[m]) + b);
    } else {
      for (int64_t i = 0; i < count; ++i)
        store(row[i], y[m][i] + (bias != nullptr ? load(bias[first + i]) : 0.f));
    }
  }
}

int64_t padded_groups(int64_t groups) { return (groups + 15) / 16 * 16; }

// float16 bits to fp32, 16 at a time (a rebias of the exponent by multiplying with 2^112):
// exact for every finite value, subnormals included, and scales and offsets are finite.
inline f32x16 widen_halves16(const at::Half* p) {
  const u32x16 bits = __builtin_convertvector(load_vector<u16x16>(p), u32x16);
  const f32x16 magnitude = (f32x16)((bits & 0x7fff) << 13) * 0x1p112f;
  return (f32x16)((u32x16)magnitude | ((bits & 0x8000) << 16));
}

void widen_halves(const at::Half* p, int64_t count, float* out) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) store_vector(out + i, widen_halves16(p + i));
  for (; i < count; ++i) out[i] = static_cast<float>(p[i]);
}

// body(first, count, scale, offset) for each block of up to kRowBlock int4 output rows in
// [begin, end), with the block's scales and offsets widened to fp32, [row][group], and 16
// zeros after the last row: a row's offsets are read in whole vectors, whatever runs past
// `groups` meets zeros in x's group sums.
template <typename Body>
void int4_row_blocks(const at::Half* scales, const at::Half* offsets, int64_t groups,
                     int64_t begin, int64_t end, Body&& body) {
  std::vector<float> scale(kRowBlock * groups + 16, 0.f), offset(kRowBlock * groups + 16, 0.f);
  for (int64_t first = begin; first < end; first += kRowBlock) {
    const int64_t count = std::min(kRowBlock, end - first);
    widen_halves(scales + first * groups, count * groups, scale.data());
    widen_halves(offsets + first * groups, count * groups, offset.data());
    body(first, count, scale.data(), offset.data());
  }
}

// out[m, n] for M rows of x and output rows [begin, end), exactly: weights widened to fp32.
// With weight = q * scale + offset, x . w = sum over chunks of scale * (x . q) + sum over
// groups of offset * sum(x): the second sum needs x's group sums only (xsum), so the inner
// loop is the nibbles' dots.
template <int M, typename T>
void int4_rows(const float* xf, const float* xsum, int64_t in, const uint8_t* weight,
               const at::Half* scales, const at::Half* offsets, int group_shift, const T* bias,
               T* out, int64_t out_stride, int64_t begin, int64_t end) {
  const int64_t chunks = in / kChunk, groups = chunks >> group_shift;
  int4_row_blocks(scales, offsets, groups, begin, end, [&](int64_t first, int64_t count,
                                                           const float* scale,
                                                           const float* offset) {
    float y[M][kRowBlock];
    for (int64_t i = 0; i < count; ++i) {
      const uint8_t* row = weight + (first + i) * in / 2;
      const float* row_scale = scale + i * groups;
      // Even and odd chunks add into separate accumulators: two dependent chains, not one.
      f32x16 even[M] = {}, odd[M] = {};
      auto add_chunk = [&](int64_t c, f32x16* acc) {
        const float s = row_scale[c >> group_shift];  // a scalar operand: broadcast in the op
        const u8x16 packed = load_vector<u8x16>(row + c * kChunk / 2);
        const f32x16 low = widen16(packed & 15), high = widen16(packed >> 4);
        for (int m = 0; m < M; ++m) {
          const float* xm = xf + m * in + c * kChunk;
          acc[m] += (low * load16(xm) + high * load16(xm + 16)) * s;
        }
      };
      int64_t c = 0;
      for (; c + 2 <= chunks; c += 2) {
        add_chunk(c, even);
        add_chunk(c + 1, odd);
      }
      if (c < chunks) add_chunk(c, even);
      const float* row_offset = offset + i * groups;
      for (int m = 0; m < M; ++m) {
        f32x16 shift = {};
        for (int64_t g = 0; g < groups; g += 16)
          shift += load16(row_offset + g) * load16(xsum + m * padded_groups(groups) + g);
        y[m][i] = sum_lanes(even[m] + odd[m] + shift);
      }
    }
    store_block<M>(out, out_stride, first, count, y, bias);
  });
}

template <int M, typename T>
void int8_rows(const float* xf, int64_t in, const int8_t* weight, const float* scales,
               const T* bias, T* out, int64_t out_stride, int64_t begin, int64_t end) {
  for (int64_t first = begin; first < end; first += kRowBlock) {
    const int64_t count = std::min(kRowBlock, end - first);
    float y[M][kRowBlock];
    for (int64_t i = 0; i < count; ++i) {
      const int8_t* row = weight + (first + i) * in;
      // Even and odd 32-weight chunks add into separate accumulators (two chains).
      f32x16 even[M] = {}, odd[M] = {};
      auto add_chunk = [&](int64_t k, f32x16* acc) {
        const f32x16 a = widen_signed16(row + k);
        const f32x16 b = widen_signed16(row + k + 16);
        for (int m = 0; m < M; ++m)
          acc[m] += a * load16(xf + m * in + k) + b * load16(xf + m * in + k + 16);
      };
      int64_t k = 0;
      for (; k + 64 <= in; k += 64) {
        add_chunk(k, even);
        add_chunk(k + 32, odd);
      }
      if (k + 32 <= in) {
        add_chunk(k, even);
        k += 32;
      }
      for (int m = 0; m < M; ++m) {
        float sum = sum_lanes(even[m] + odd[m]);
        for (int64_t tail = k; tail < in; ++tail) sum += row[tail] * xf[m * in + tail];
        y[m][i] = sum * scales[first + i];
      }
    }
    store_block<M>(out, out_stride, first, count, y, bias);
  }
}

#if defined(KVSCOPE_VNNI_DOTS)
constexpr int64_t kBlock = 32;  // activations share one int8 scale per 32 values (Q8_0)

// Rows of bf16 x rounded to int8, llama.cpp's Q8_0: per block of 32 values d = max|x| / 127
// and q = round(x * (1 / d)), ties to even; values past `in` are zeros. A block is one
// 256-bit vpdpbusd operand, in x's own order, which is also the order a Q4 chunk unpacks in
// (low nibbles: weights 0..15, high nibbles: 16..31). 256-bit rather than 512-bit dots: on
// Zen 4 both move the same bytes per cycle, and one block per dot needs only its scalar
// scales (broadcast in the multiply), where two would need a lane shuffle per dot.
struct Int8Rows {
  int64_t blocks = 0;
  std::vector<int8_t> q;           // [rows][blocks * 32]
  std::vector<float> scales;       // [rows][blocks]: d
  std::vector<float> block_sums;   // [rows][blocks]: d * sum(q), the rounded block's sum
  float scaled_q_sums[kMaxRows] = {};  // per row: the rounded row's sum
};

inline __m512 load_bf16x16(const bf16* p, __mmask16 mask) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? 0xFFFF : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}

Int8Rows quantize_rows(const bf16* x, int64_t x_stride, int rows, int64_t in) {
  Int8Rows r;
  r.blocks = (in + kBlock - 1) / kBlock;
  r.q.assign(rows * r.blocks * kBlock, 0);
  r.scales.assign(rows * r.blocks, 0.f);
  r.block_sums.assign(rows * r.blocks, 0.f);
  for (int m = 0; m < rows; ++m) {
    for (int64_t b = 0; b < r.blocks; ++b) {
      const bf16* values = x + m * x_stride + b * kBlock;
      const int64_t count = std::min(kBlock, in - b * kBlock);
      const __m512 low = load_bf16x16(values, first_lanes(count));
      const __m512 high = load_bf16x16(values + 16, first_lanes(count - 16));
      const float d =
          _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high))) / 127.f;
      const __m512 inverse = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
      const __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));
      const __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
      const int64_t at = m * r.blocks + b;
      r.scales[at] = d;
      r.block_sums[at] =
          d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high)));
      r.scaled_q_sums[m] += r.block_sums[at];
      int8_t* block = r.q.data() + at * kBlock;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(block), _mm512_cvtsepi32_epi8(q_low));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(block + 16), _mm512_cvtsepi32_epi8(q_high));
    }
  }
  return r;
}

// d * (weights . q) for block `at` of the rounded x: 32 unsigned weight bytes times its 32
// int8 in one vpdpbusd, the int32 sums scaled in fp32.
inline __m256 scaled_block_dot(const Int8Rows& xq, int64_t at, __m256i weights) {
  const __m256i dot = _mm256_dpbusd_epi32(
      _mm256_setzero_si256(), weights,
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + at * kBlock)));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xq.scales[at]));
}

// add(k, chain) for k in [0, count), even k into `even` and odd k into `odd`: two
// dependent chains of accumulators, not one.
template <typename Add, typename Chain>
inline void in_two_chains(int64_t count, Add&& add, Chain* even, Chain* odd) {
  int64_t k = 0;
  for (; k + 2 <= count; k += 2) {
    add(k, even);
    add(k + 1, odd);
  }
  if (k < count) add(k, even);
}

// int4 rows with VNNI: per chunk, its 32 nibbles (u8 0..15) times the 32 int8 of x in one
// vpdpbusd per row of x; the int32 sums are scaled by the block's activation scale and the
// chunk's weight scale. The offsets' term uses the rounded x's group sums (as llama.cpp's
// Q8_1 does), so the result is the rounded x's exact dot with the de-quantized weights:
// with x's own sums, the rounding would meet q * scale (0 to the group's range) instead of
// the weight itself (centred near zero), a several times larger error.
template <int M>
void int4_rows_vnni(const Int8Rows& xq, const float* xsum, int64_t in, const uint8_t* weight,
                    const at::Half* scales, const at::Half* offsets, int group_shift,
                    const bf16* bias, bf16* out, int64_t out_stride, int64_t begin,
                    int64_t end) {
  const int64_t chunks = in / kChunk, groups = chunks >> group_shift;
  const __m256i nibble = _mm256_set1_epi8(15);
  int4_row_blocks(scales, offsets, groups, begin, end, [&](int64_t first, int64_t count,
                                                           const float* scale,
                                                           const float* offset) {
    float y[M][kRowBlock];
    for (int64_t i = 0; i < count; ++i) {
      const uint8_t* row = weight + (first + i) * in / 2;
      const float* row_scale = scale + i * groups;
      __m256 even[M], odd[M];
      for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm256_setzero_ps();
      auto add_chunk = [&](int64_t c, __m256* acc) {
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 16));
        const __m256i q = _mm256_and_si256(
            _mm256_inserti128_si256(_mm256_castsi128_si256(packed), _mm_srli_epi16(packed, 4), 1),
            nibble);
        const __m256 w_scale = _mm256_set1_ps(row_scale[c >> group_shift]);
        for (int m = 0; m < M; ++m)
          acc[m] = _mm256_fmadd_ps(scaled_block_dot(xq, m * xq.blocks + c, q), w_scale, acc[m]);
      };
      in_two_chains(chunks, add_chunk, even, odd);
      const float* row_offset = offset + i * groups;
      for (int m = 0; m < M; ++m) {
        __m512 shift = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g += 16)
          shift = _mm512_fmadd_ps(_mm512_loadu_ps(row_offset + g),
                                  _mm512_loadu_ps(xsum + m * padded_groups(groups) + g), shift);
        const __m256 folded = _mm256_add_ps(_mm512_castps512_ps256(shift),
                                            _mm512_extractf32x8_ps(shift, 1));
        y[m][i] = sum_lanes(_mm256_add_ps(_mm256_add_ps(even[m], odd[m]), folded));
      }
    }
    store_block<M>(out, out_stride, first, count, y, bias);
  });
}

// int8 rows with VNNI: vpdpbusd wants one unsigned operand, so the weights are flipped to
// u = q + 128 (one xor per block) and the extra 128 * (x's rounded sum) comes off once per
// output: sum_b d_b * (u . q_x) = x . w + 128 * sum_b d_b * sum(q_x), the last independent of
// the weight row (scaled_q_sums).
template <int M>
void int8_rows_vnni(const Int8Rows& xq, int64_t in, const int8_t* weight, const float* scales,
                    const bf16* bias, bf16* out, int64_t out_stride, int64_t begin,
                    int64_t end) {
  const int64_t blocks = xq.blocks, full_blocks = in / kBlock;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (in % kBlock)) - 1);
  const __m256i flip = _mm256_set1_epi8(-128);
  for (int64_t first = begin; first < end; first += kRowBlock) {
    const int64_t count = std::min(kRowBlock, end - first);
    float y[M][kRowBlock];
    for (int64_t i = 0; i < count; ++i) {
      const int8_t* row = weight + (first + i) * in;
      __m256 even[M], odd[M];
      for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm256_setzero_ps();
      auto add_block = [&](int64_t b, __m256* acc) {
        // Bytes past `in` load as zeros (their x is zero too).
        const __m256i w = b < full_blocks
            ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBlock))
            : _mm256_maskz_loadu_epi8(tail, row + b * kBlock);
        const __m256i u = _mm256_xor_si256(w, flip);
        for (int m = 0; m < M; ++m)
          acc[m] = _mm256_add_ps(acc[m], scaled_block_dot(xq, m * blocks + b, u));
      };
      in_two_chains(blocks, add_block, even, odd);
      for (int m = 0; m < M; ++m)
        y[m][i] = (sum_lanes(_mm256_add_ps(even[m], odd[m])) - 128.f * xq.scaled_q_sums[m]) *
                  scales[first + i];
    }
    store_block<M>(out, out_stride, first, count, y, bias);
  }
}
#endif


// Calls body(std::integral_constant<int, rows>) for rows in 1..kMaxRows: each row count
// is a compile-time constant, so its accumulators stay in registers.
template <int M = kMaxRows, typename Body>
void with_rows(int rows, Body&& body) {
  if constexpr (M > 1) {
    if (rows < M) return with_rows<M - 1>(rows, body);
  }
  body(std::integral_constant<int, M>{});
}

// Whether bf16 activations are rounded to int8 for VNNI dot products on this build.
bool rounds_activations_to_int8() {
#if defined(KVSCOPE_VNNI_DOTS)
  return true;
#else
  return false;
#endif
}

template <typename T>
void int4_linear_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                      const at::Tensor& offsets, int64_t group_size, const T* bias,
                      at::Tensor& out) {
  const int64_t in = x.size(1), out_features = weight.size(0), groups = in / group_size;
  const int group_shift = __builtin_ctzll(group_size / kChunk);
  for (int64_t first = 0; first < x.size(0); first += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, x.size(0) - first));
    const T* x_rows = elements<T>(x) + first * x.stride(0);
    T* y = elements<T>(out) + first * out.stride(0);
    // x's group sums (for the offsets), zeros past `groups` in each row (read as vectors).
    std::vector<float> xsum(rows * padded_groups(groups), 0.f);
#if defined(KVSCOPE_VNNI_DOTS)
    if constexpr (std::is_same_v<T, bf16>) {
      const Int8Rows xq = quantize_rows(x_rows, x.stride(0), rows, in);
      for (int m = 0; m < rows; ++m)
        for (int64_t c = 0; c < xq.blocks; ++c)
          xsum[m * padded_groups(groups) + (c >> group_shift)] += xq.block_sums[m * xq.blocks + c];
      with_rows(rows, [&](auto rows_constant) {
        constexpr int M = decltype(rows_constant)::value;
        kvscope::parallel_for(0, out_features, grain(in / 2), [&](int64_t begin, int64_t end) {
          int4_rows_vnni<M>(xq, xsum.data(), in, weight.data_ptr<uint8_t>(),
                            scales.data_ptr<at::Half>(), offsets.data_ptr<at::Half>(),
                            group_shift, bias, y, out.stride(0), begin, end);
        });
      });
      continue;
    }
#endif
    const std::vector<float> xf = widen(x_rows, x.stride(0), rows, in);
    for (int m = 0; m < rows; ++m)
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k)
          xsum[m * padded_groups(groups) + g] += xf[m * in + k];
    with_rows(rows, [&](auto rows_constant) {
      constexpr int M = decltype(rows_constant)::value;
      kvscope::parallel_for(0, out_features, grain(in / 2), [&](int64_t begin, int64_t end) {
        int4_rows<M, T>(xf.data(), xsum.data(), in, weight.data_ptr<uint8_t>(),
                        scales.data_ptr<at::Half>(), offsets.data_ptr<at::Half>(),
                        group_shift, bias, y, out.stride(0), begin, end);
      });
    });
  }
}

template <typename T>
void int8_linear_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                      const T* bias, at::Tensor& out) {
  const int64_t in = x.size(1), out_features = weight.size(0);
  for (int64_t first = 0; first < x.size(0); first += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, x.size(0) - first));
    const T* x_rows = elements<T>(x) + first * x.stride(0);
    T* y = elements<T>(out) + first * out.stride(0);
#if defined(KVSCOPE_VNNI_DOTS)
    if constexpr (std::is_same_v<T, bf16>) {
      const Int8Rows xq = quantize_rows(x_rows, x.stride(0), rows, in);
      with_rows(rows, [&](auto rows_constant) {
        constexpr int M = decltype(rows_constant)::value;
        kvscope::parallel_for(0, out_features, grain(in), [&](int64_t begin, int64_t end) {
          int8_rows_vnni<M>(xq, in, weight.data_ptr<int8_t>(), scales.data_ptr<float>(), bias,
                            y, out.stride(0), begin, end);
        });
      });
      continue;
    }
#endif
    const std::vector<float> xf = widen(x_rows, x.stride(0), rows, in);
    with_rows(rows, [&](auto rows_constant) {
      constexpr int M = decltype(rows_constant)::value;
      kvscope::parallel_for(0, out_features, grain(in), [&](int64_t begin, int64_t end) {
        int8_rows<M, T>(xf.data(), in, weight.data_ptr<int8_t>(), scales.data_ptr<float>(),
                        bias, y, out.stride(0), begin, end);
      });
    });
  }
}


void check_rows(const at::Tensor& x, const at::Tensor& weight, int64_t in,
                const std::optional<at::Tensor>& bias, const at::Tensor& out, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == in, op,
              ": x [rows, in] with contiguous features");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x float32 or bfloat16");
  TORCH_CHECK(weight.is_contiguous() && out.is_contiguous() && out.dim() == 2 &&
              out.size(0) == x.size(0) && out.size(1) == weight.size(0) &&
              out.scalar_type() == x.scalar_type(), op, ": out [rows, out_features] of x's dtype");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == weight.size(0) &&
                        bias->scalar_type() == x.scalar_type()), op, ": bias [out_features]");
}

void check_int4_weight(const at::Tensor& weight, const at::Tensor& scales,
                       const at::Tensor& offsets, int64_t group_size, int64_t in, const char* op) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 &&
              weight.size(1) * 2 == in, op, ": weight uint8 [out_features, in / 2]");
  TORCH_CHECK(group_size >= kChunk && (group_size & (group_size - 1)) == 0 &&
              in % group_size == 0, op, ": group_size a power of two >= 32 that divides in");
  for (const at::Tensor* part : {&scales, &offsets})
    TORCH_CHECK(part->scalar_type() == at::kHalf && part->is_contiguous() &&
                part->dim() == 2 && part->size(0) == weight.size(0) &&
                part->size(1) == in / group_size, op,
                ": scales and offsets float16 [out_features, in / group_size]");
}

void check_int8_weight(const at::Tensor& weight, const at::Tensor& scales, const char* op) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(),
              op, ": weight int8 [out_features, in]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
              scales.numel() == weight.size(0), op, ": scales float32 [out_features]");
}

template <typename T>
const T* bias_data(const std::optional<at::Tensor>& bias) {
  return bias ? elements<T>(*bias) : nullptr;
}

}  // namespace

// out = x @ W.T + bias with W the de-quantized int4 weight (see the top of the file).
void int4_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                 const at::Tensor& offsets, int64_t group_size,
                 const std::optional<at::Tensor>& bias, at::Tensor out) {
  check_rows(x, weight, weight.size(1) * 2, bias, out, "int4_linear");
  check_int4_weight(weight, scales, offsets, group_size, x.size(1), "int4_linear");
  if (x.scalar_type() == at::kFloat)
    int4_linear_impl<float>(x, weight, scales, offsets, group_size, bias_data<float>(bias), out);
  else
    int4_linear_impl<bf16>(x, weight, scales, offsets, group_size, bias_data<bf16>(bias), out);
}

// out = x @ (q * scale).T + bias with int8 q [out_features, in] and fp32 scale per row.
void int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                 const std::optional<at::Tensor>& bias, at::Tensor out) {
  check_rows(x, weight, weight.size(1), bias, out, "int8_linear");
  check_int8_weight(weight, scales, "int8_linear");
  if (x.scalar_type() == at::kFloat)
    int8_linear_impl<float>(x, weight, scales, bias_data<float>(bias), out);
  else
    int8_linear_impl<bf16>(x, weight, scales, bias_data<bf16>(bias), out);
}

namespace {

// Rows [begin, end) of weights, de-quantized (computed in fp32, rounded once to T).
template <typename T>
void int4_dequantize_rows(const uint8_t* weight, const at::Half* scales,
                          const at::Half* offsets, int64_t group_size, int64_t in, T* out,
                          int64_t begin, int64_t end) {
  const int64_t groups = in / group_size;
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t g = 0; g < groups; ++g) {
      const float s = static_cast<float>(scales[n * groups + g]);
      const float o = static_cast<float>(offsets[n * groups + g]);
      for (int64_t k = g * group_size; k < (g + 1) * group_size; k += kChunk) {
        const u8x16 packed = load_vector<u8x16>(weight + (n * in + k) / 2);
        store16(out + n * in + k, widen16(packed & 15) * s + o);
        store16(out + n * in + k + 16, widen16(packed >> 4) * s + o);
      }
    }
  }
}

template <typename T>
void int8_dequantize_rows(const int8_t* weight, const float* scales, int64_t in, T* out,
                          int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* row = weight + n * in;
    T* y = out + n * in;
    int64_t k = 0;
    for (; k + 16 <= in; k += 16) store16(y + k, widen_signed16(row + k) * scales[n]);
    for (; k < in; ++k) store(y[k], row[k] * scales[n]);
  }
}

// Calls body(T* out) with out's data as float or bf16 bits.
template <typename Body>
void with_out_dtype(at::Tensor& out, const char* op, Body&& body) {
  if (out.scalar_type() == at::kFloat) return body(out.data_ptr<float>());
  TORCH_CHECK(out.scalar_type() == at::kBFloat16, op, ": out float32 or bfloat16");
  body(elements<bf16>(out));
}

void check_dense_out(const at::Tensor& weight, int64_t in, const at::Tensor& out,
                     const char* op) {
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == weight.size(0) &&
              out.size(1) == in, op, ": out [out_features, in]");
}

}  // namespace

// out [out_features, in] = the de-quantized int4 weight, for the GEMM of many rows.
void int4_dequantize(const at::Tensor& weight, const at::Tensor& scales,
                     const at::Tensor& offsets, int64_t group_size, at::Tensor out) {
  const int64_t in = weight.size(1) * 2;
  check_int4_weight(weight, scales, offsets, group_size, in, "int4_dequantize");
  check_dense_out(weight, in, out, "int4_dequantize");
  with_out_dtype(out, "int4_dequantize", [&](auto* y) {
    kvscope::parallel_for(0, weight.size(0), grain(in / 2), [&](int64_t begin, int64_t end) {
      int4_dequantize_rows(weight.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                           offsets.data_ptr<at::Half>(), group_size, in, y, begin, end);
    });
  });
}

// out [out_features, in] = the de-quantized int8 weight, for the GEMM of many rows.
void int8_dequantize(const at::Tensor& weight, const at::Tensor& scales, at::Tensor out) {
  check_int8_weight(weight, scales, "int8_dequantize");
  const int64_t in = weight.size(1);
  check_dense_out(weight, in, out, "int8_dequantize");
  with_out_dtype(out, "int8_dequantize", [&](auto* y) {
    kvscope::parallel_for(0, weight.size(0), grain(in), [&](int64_t begin, int64_t end) {
      int8_dequantize_rows(weight.data_ptr<int8_t>(), scales.data_ptr<float>(), in, y, begin,
                           end);
    });
  });
}

TORCH_LIBRARY_FRAGMENT(kvscope, m) {
  m.def("int4_linear(Tensor x, Tensor weight, Tensor scales, Tensor offsets, int group_size, "
        "Tensor? bias, Tensor(a!) out) -> ()");
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales, Tensor? bias, "
        "Tensor(a!) out) -> ()");
  m.def("int4_dequantize(Tensor weight, Tensor scales, Tensor offsets, int group_size, "
        "Tensor(a!) out) -> ()");
  m.def("int8_dequantize(Tensor weight, Tensor scales, Tensor(a!) out) -> ()");
  m.def("rounds_activations_to_int8() -> bool", &rounds_activations_to_int8);
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("int8_dequantize", &int8_dequantize);
}
