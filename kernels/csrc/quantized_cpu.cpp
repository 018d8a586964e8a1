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
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_common.h"

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
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
// Fewest weight bytes one thread streams per call. On a busy 2-core machine a parallel
// region waits for a descheduled worker: measured (bench/quantized_linear.py), a 1.8 MB
// layer took 2.3x longer on 2 threads than on 1, the 28 MB lm_head half as long. So only
// layers of several MB split.
constexpr int64_t kBytesPerTask = 4 << 20;

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

// `extra` folded into `lanes`' width, added to it.
inline f32x16 fold(f32x16 extra, f32x16 lanes) { return lanes + extra; }
inline f32x8 fold(f32x16 extra, f32x8 lanes) {
  f32x8 low, high;
  std::memcpy(&low, &extra, sizeof(low));
  std::memcpy(&high, reinterpret_cast<const char*>(&extra) + sizeof(low), sizeof(high));
  return lanes + low + high;
}

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

// out[m, n] for M rows of x and output rows [begin, end). With weight = q * scale + offset,
// x . w = sum over chunks of scale * (x . q) + sum over groups of offset * sum(x): the
// second sum needs x's group sums only (xsum), so the inner loop is the nibbles' dots.
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
constexpr bool kBf16Dot = true;

// The dot of one 32-weight chunk with 32 bf16 values of x, on a CPU with AVX512-BF16
// (Zen 4, Sapphire Rapids): each nibble q becomes the bf16 number 128 + q by OR-ing 0x4300
// into it (exact: 128..143 need 8 significant bits, bf16's count), and vdpbf16ps multiplies
// 16 of those by 16 of x's values and adds pairs into 8 fp32 lanes in one instruction, a
// third of the work of widening both to fp32. The extra 128 * sum(x) comes off with the
// offsets (int4_rows). The products are exact; only the fp32 sums round.
inline __m256 bf16_chunk_dot(__m256i bytes, const bf16* x) {
  const __m256i bf16_128 = _mm256_set1_epi16(0x4300);
  const __m256i low = _mm256_or_si256(_mm256_and_si256(bytes, _mm256_set1_epi16(15)), bf16_128);
  const __m256i high = _mm256_or_si256(_mm256_srli_epi16(bytes, 4), bf16_128);
  const __m256i x_low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i x_high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
  const __m256 dot = _mm256_dpbf16_ps(_mm256_setzero_ps(), (__m256bh)low, (__m256bh)x_low);
  return _mm256_dpbf16_ps(dot, (__m256bh)high, (__m256bh)x_high);
}
#else
constexpr bool kBf16Dot = false;
#endif

// out[m, n] for M rows of x and output rows [begin, end). With weight = q * scale + offset,
// x . w = sum over chunks of scale * (x . q) + sum over groups of offset * sum(x): the
// second sum needs x's group sums only (xsum), so the inner loop is the nibbles' dots,
// in fp32 (xf, x widened) or, for bf16 x where the CPU has it, as bf16 dot products.
template <int M, typename T>
void int4_rows(const T* x, int64_t x_stride, const float* xf, const float* xsum, int64_t in,
               const uint8_t* weight, const at::Half* scales, const at::Half* offsets,
               int group_shift, const T* bias, T* out, int64_t out_stride, int64_t begin,
               int64_t end) {
  constexpr bool bf16_dot = kBf16Dot && std::is_same_v<T, bf16>;
  using Lanes = std::conditional_t<bf16_dot, f32x8, f32x16>;  // what a chunk's dot fills
  const int64_t chunks = in / kChunk, groups = chunks >> group_shift;
  // One block's scales and offsets, [row][group], with 16 zeros after the last row: a
  // row's offsets are read in whole vectors, whatever ran past `groups` meets zeros in xsum.
  std::vector<float> scale(kRowBlock * groups + 16, 0.f), offset(kRowBlock * groups + 16, 0.f);
  for (int64_t first = begin; first < end; first += kRowBlock) {
    const int64_t count = std::min(kRowBlock, end - first);
    widen_halves(scales + first * groups, count * groups, scale.data());
    widen_halves(offsets + first * groups, count * groups, offset.data());
    float y[M][kRowBlock];
    for (int64_t i = 0; i < count; ++i) {
      const uint8_t* row = weight + (first + i) * in / 2;
      const float* row_scale = scale.data() + i * groups;
      // Even and odd chunks add into separate accumulators: two dependent chains, not one.
      Lanes even[M] = {}, odd[M] = {};
      auto add_chunk = [&](int64_t c, Lanes* acc) {
        const float s = row_scale[c >> group_shift];  // a scalar operand: broadcast in the op
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
        if constexpr (bf16_dot) {
          const __m256i bytes = _mm256_cvtepu8_epi16(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * kChunk / 2)));
          for (int m = 0; m < M; ++m)
            acc[m] += (f32x8)bf16_chunk_dot(bytes, x + m * x_stride + c * kChunk) * s;
          return;
        }
#endif
        if constexpr (!bf16_dot) {
          const u8x16 packed = load_vector<u8x16>(row + c * kChunk / 2);
          const f32x16 low = widen16(packed & 15), high = widen16(packed >> 4);
          for (int m = 0; m < M; ++m) {
            const float* xm = xf + m * in + c * kChunk;
            acc[m] += (low * load16(xm) + high * load16(xm + 16)) * s;
          }
        }
      };
      int64_t c = 0;
      for (; c + 2 <= chunks; c += 2) {
        add_chunk(c, even);
        add_chunk(c + 1, odd);
      }
      if (c < chunks) add_chunk(c, even);
      const float* row_offset = offset.data() + i * groups;
      for (int m = 0; m < M; ++m) {
        f32x16 shift = {};
        for (int64_t g = 0; g < groups; g += 16) {
          f32x16 o = load16(row_offset + g);
          if constexpr (bf16_dot) o -= 128.f * load16(row_scale + g);  // dots summed 128 + q
          shift += o * load16(xsum + m * padded_groups(groups) + g);
        }
        y[m][i] = sum_lanes(fold(shift, even[m] + odd[m]));
      }
    }
    store_block<M>(out, out_stride, first, count, y, bias);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// The dot of 32 int8 weights with 32 bf16 values of x, with AVX512-BF16: u = q + 128 splits
// into nibbles, u = 16 * high + low; the high ones become the exact bf16 number
// 2048 + 16 * high (bits 0x4500 | high), the low ones 128 + low (as in int4), and two dot
// products with the same x sum (2048 + 16 * high + 128 + low) * x = (q + 2304) * x.
inline __m256 bf16_int8_dot(const int8_t* w, const bf16* x) {
  const __m256i bytes = _mm256_xor_si256(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), _mm256_set1_epi8(-128));
  __m256 dot = _mm256_setzero_ps();
  for (int half = 0; half < 2; ++half) {
    const __m256i u = _mm256_cvtepu8_epi16(half == 0 ? _mm256_castsi256_si128(bytes)
                                                     : _mm256_extracti128_si256(bytes, 1));
    const __m256i low = _mm256_or_si256(_mm256_and_si256(u, _mm256_set1_epi16(15)),
                                        _mm256_set1_epi16(0x4300));
    const __m256i high = _mm256_or_si256(_mm256_srli_epi16(u, 4), _mm256_set1_epi16(0x4500));
    const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * half));
    dot = _mm256_dpbf16_ps(dot, (__m256bh)low, (__m256bh)xs);
    dot = _mm256_dpbf16_ps(dot, (__m256bh)high, (__m256bh)xs);
  }
  return dot;
}
#endif

// xmain[m]: the sum of x's first in / 32 * 32 values, which the bf16 dots count 2304 times.
template <int M, typename T>
void int8_rows(const T* x, int64_t x_stride, const float* xf, const float* xmain, int64_t in,
               const int8_t* weight, const float* scales, const T* bias, T* out,
               int64_t out_stride, int64_t begin, int64_t end) {
  constexpr bool bf16_dot = kBf16Dot && std::is_same_v<T, bf16>;
  using Lanes = std::conditional_t<bf16_dot, f32x8, f32x16>;
  for (int64_t first = begin; first < end; first += kRowBlock) {
    const int64_t count = std::min(kRowBlock, end - first);
    float y[M][kRowBlock];
    for (int64_t i = 0; i < count; ++i) {
      const int8_t* row = weight + (first + i) * in;
      // Even and odd 32-weight chunks add into separate accumulators (two chains).
      Lanes even[M] = {}, odd[M] = {};
      auto add_chunk = [&](int64_t k, Lanes* acc) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
        if constexpr (bf16_dot) {
          for (int m = 0; m < M; ++m)
            acc[m] += (f32x8)bf16_int8_dot(row + k, x + m * x_stride + k);
          return;
        }
#endif
        if constexpr (!bf16_dot) {
          const f32x16 a = widen_signed16(row + k);
          const f32x16 b = widen_signed16(row + k + 16);
          for (int m = 0; m < M; ++m)
            acc[m] += a * load16(xf + m * in + k) + b * load16(xf + m * in + k + 16);
        }
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
        float sum = sum_lanes(even[m] + odd[m]) - (bf16_dot ? 2304.f * xmain[m] : 0.f);
        for (int64_t tail = k; tail < in; ++tail) sum += row[tail] * xf[m * in + tail];
        y[m][i] = sum * scales[first + i];
      }
    }
    store_block<M>(out, out_stride, first, count, y, bias);
  }
}

// Calls body(std::integral_constant<int, rows>) for rows in 1..kMaxRows: each row count
// is a compile-time constant, so its accumulators stay in registers.
template <int M = kMaxRows, typename Body>
void with_rows(int rows, Body&& body) {
  if constexpr (M > 1) {
    if (rows < M) return with_rows<M - 1>(rows, body);
  }
  body(std::integral_constant<int, M>{});
}

template <typename T>
void int4_linear_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                      const at::Tensor& offsets, int64_t group_size, const T* bias,
                      at::Tensor& out) {
  const int64_t in = x.size(1), out_features = weight.size(0), groups = in / group_size;
  for (int64_t first = 0; first < x.size(0); first += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, x.size(0) - first));
    const std::vector<float> xf = widen(elements<T>(x) + first * x.stride(0), x.stride(0),
                                        rows, in);
    // Zeros past `groups` in each row (int4_rows reads whole vectors).
    std::vector<float> xsum(rows * padded_groups(groups), 0.f);
    for (int m = 0; m < rows; ++m)
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k)
          xsum[m * padded_groups(groups) + g] += xf[m * in + k];
    const int group_shift = __builtin_ctzll(group_size / kChunk);
    T* y = elements<T>(out) + first * out.stride(0);
    with_rows(rows, [&](auto rows_constant) {
      constexpr int M = decltype(rows_constant)::value;
      at::parallel_for(0, out_features, grain(in / 2), [&](int64_t begin, int64_t end) {
        int4_rows<M, T>(elements<T>(x) + first * x.stride(0), x.stride(0), xf.data(),
                        xsum.data(), in, weight.data_ptr<uint8_t>(),
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
    const std::vector<float> xf = widen(elements<T>(x) + first * x.stride(0), x.stride(0),
                                        rows, in);
    float xmain[kMaxRows] = {};
    for (int m = 0; m < rows; ++m)
      for (int64_t k = 0; k < in / 32 * 32; ++k) xmain[m] += xf[m * in + k];
    T* y = elements<T>(out) + first * out.stride(0);
    with_rows(rows, [&](auto rows_constant) {
      constexpr int M = decltype(rows_constant)::value;
      at::parallel_for(0, out_features, grain(in), [&](int64_t begin, int64_t end) {
        int8_rows<M, T>(elements<T>(x) + first * x.stride(0), x.stride(0), xf.data(), xmain,
                        in, weight.data_ptr<int8_t>(), scales.data_ptr<float>(), bias, y,
                        out.stride(0), begin, end);
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
    at::parallel_for(0, weight.size(0), grain(in / 2), [&](int64_t begin, int64_t end) {
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
    at::parallel_for(0, weight.size(0), grain(in), [&](int64_t begin, int64_t end) {
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
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("int8_dequantize", &int8_dequantize);
}
