// Linears over weight-only quantized weights (engine/models/quantized.py) for a few rows of
// activations: a single stream's decode reads every weight once per token, so these
// kernels stream the packed bytes once, de-quantize them in registers and dot them with
// every row of x while they are there. Many rows are compute-bound instead: those
// de-quantize the weight (int4_dequantize) and run a GEMM.
//
// int4: GGUF's Q4 chunks, byte j of each 16-byte chunk holding weight j (low nibble) and
// weight j + 16 (high nibble) of 32 consecutive inputs; weight = q * scale + offset with an
// fp16 scale and offset per group of inputs (Q4_0 / Q4_1 blocks copy in exactly). Each row's
// chunks are repacked (engine/models/quantized.py, once at load time) in "wide blocks" of 16
// chunks, [t 0..3][chunk 0..15][4 bytes] (bytes 4t..4t+3 of every chunk in one 64-byte
// load, chunk j in int32 lane j of a vpdpbusd); the chunks after the last whole block stay
// in GGUF's order.
// int8: one int8 per weight in x's order, weight = q * scale with one fp32 scale per output row.
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
using kvscope::round_to;
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

constexpr int64_t kWideChunks = 16;  // int4 chunks in one wide block (see the top)

// One int4 row in GGUF's chunk order again: the wide blocks un-transposed, the rest copied.
void gguf_order_row(const uint8_t* row, int64_t chunks, uint8_t* out) {
  const int64_t wide = chunks / kWideChunks;
  for (int64_t k = 0; k < wide; ++k)
    for (int64_t j = 0; j < kWideChunks; ++j)
      for (int64_t t = 0; t < 4; ++t)
        std::memcpy(out + (k * kWideChunks + j) * 16 + 4 * t,
                    row + k * kWideChunks * 16 + t * 64 + 4 * j, 4);
  std::memcpy(out + wide * kWideChunks * 16, row + wide * kWideChunks * 16,
              (chunks - wide * kWideChunks) * 16);
}

// Outputs are computed for blocks of 16 consecutive output rows: the block's scales and
// offsets widen in whole vectors, and its outputs (+ bias) are stored as vectors too.
constexpr int64_t kRowBlock = 16;

inline void store16(float* p, f32x16 v) { store_vector(p, v); }

// v rounded to T's precision, still in fp32 lanes (what storing to T and loading gives).
inline f32x16 round16(f32x16 v, float*) { return v; }

// Round to nearest even, as kvscope::bf16_bits does for every finite value.
inline f32x16 round16(f32x16 v, bf16*) {
  u32x16 bits = (u32x16)v;
  bits += 0x7FFF + ((bits >> 16) & 1);
  return (f32x16)(bits & 0xFFFF0000u);
}

inline void store16(bf16* p, f32x16 v) {
  const u32x16 bits = (u32x16)round16(v, static_cast<bf16*>(nullptr));
  store_vector(p, __builtin_convertvector(bits >> 16, u16x16));
}

inline f32x16 load16(const bf16* p) {
  return (f32x16)(__builtin_convertvector(load_vector<u16x16>(p), u32x16) << 16);
}

// out[m, first + i] = y[m][i] + bias[first + i] for the `count` rows of one block, rounded
// to T (x's dtype) whatever Out is: an fp32 out of bf16 x (the logits) holds exactly what
// widening the bf16 result would give, without a pass over it for that.
template <int M, typename T, typename Out>
void store_block(Out* out, int64_t out_stride, int64_t first, int64_t count,
                 const float (&y)[M][kRowBlock], const T* bias) {
  constexpr T* precision = nullptr;
  for (int m = 0; m < M; ++m) {
    Out* row = out + m * out_stride + first;
    if (count == kRowBlock) {
      const f32x16 b = bias != nullptr ? load16(bias + first) : f32x16{};
      store16(row, round16(load16(y[m]) + b, precision));
    } else {
      for (int64_t i = 0; i < count; ++i)
        store(row[i],
              round_to(y[m][i] + (bias != nullptr ? load(bias[first + i]) : 0.f), precision));
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
    std::vector<uint8_t> ordered(in / 2);
    for (int64_t i = 0; i < count; ++i) {
      gguf_order_row(weight + (first + i) * in / 2, chunks, ordered.data());
      const uint8_t* row = ordered.data();
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

template <int M, typename T, typename Out>
void int8_rows(const float* xf, int64_t in, const int8_t* weight, const float* scales,
               const T* bias, Out* out, int64_t out_stride, int64_t begin, int64_t end) {
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
// and q = round(x * (1 / d)), ties to even; values past `in` are zeros. The kernels read
// them re-laid for their weight layouts (int4_lanes, int8_lanes).
struct Int8Rows {
  int64_t blocks = 0;
  std::vector<int8_t> q;           // [rows][blocks * 32]
  std::vector<float> scales;       // [rows][blocks]: d
  std::vector<float> block_sums;   // [rows][blocks]: d * sum(q), the rounded block's sum
  std::vector<float> scaled_q_sums;  // per row: the rounded row's sum
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
  r.scaled_q_sums.assign(rows, 0.f);
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

// The rounded x laid out for 512-bit dots against 64 packed weight bytes at once, [rows]
// of `row_bytes` each, on 64-byte lines; chunks past `in` are zeros (q and d), so a tail
// needs only a masked weight load.
struct Int8Lanes {
  int64_t row_bytes = 0;
  std::vector<uint8_t> storage;
  uint8_t* data = nullptr;

  Int8Lanes(int rows, int64_t bytes_per_row)
      : row_bytes(bytes_per_row), storage(rows * bytes_per_row + 63, 0) {
    data = storage.data() + (-reinterpret_cast<uintptr_t>(storage.data()) & 63);
  }
  Int8Lanes(Int8Lanes&&) = default;  // the buffer moves with `storage`, so `data` stays valid

  uint8_t* row(int m) const { return data + m * row_bytes; }
};

constexpr int64_t kStepBytes = 64;  // weight bytes one 512-bit dot reads

// int4, wide blocks (see the layout at the top of the file): per block of 16 chunks and
// per t in 0..3, `low` holds x[chunk j][4t..4t+3] in int32 lane j and `high` x[chunk j]
// [16+4t..+3]; then each chunk's d in its lane. 8 vpdpbusd sum a chunk's dot in its lane.
constexpr int64_t kWideBytes = kWideChunks * kChunk / 2;
constexpr int64_t kWideLaneBytes = 8 * kStepBytes + 64;
// int4, the chunks after the wide blocks in GGUF's order, 4 per 64-byte load (a quad):
// `& 15` gives each chunk's weights 0..15 in its 16-byte lane and `>> 4 & 15` its weights
// 16..31, so `low` holds the 4 chunks' x 0..15, `high` x 16..31, and each chunk's d fills
// the 4 int32 lanes its dot lands in.
constexpr int64_t kQuadLaneBytes = 2 * kStepBytes + 64;

Int8Lanes int4_lanes(const Int8Rows& xq, int rows) {
  const int64_t wide = xq.blocks / kWideChunks, tail = xq.blocks % kWideChunks;
  Int8Lanes lanes(rows, wide * kWideLaneBytes + (tail + 3) / 4 * kQuadLaneBytes);
  for (int m = 0; m < rows; ++m)
    for (int64_t c = 0; c < xq.blocks; ++c) {
      const int8_t* block = xq.q.data() + (m * xq.blocks + c) * kBlock;
      const float d = xq.scales[m * xq.blocks + c];
      if (c < wide * kWideChunks) {
        uint8_t* at = lanes.row(m) + c / kWideChunks * kWideLaneBytes;
        const int64_t j = c % kWideChunks;
        for (int t = 0; t < 4; ++t) {
          std::memcpy(at + 2 * t * kStepBytes + 4 * j, block + 4 * t, 4);
          std::memcpy(at + (2 * t + 1) * kStepBytes + 4 * j, block + 16 + 4 * t, 4);
        }
        reinterpret_cast<float*>(at + 8 * kStepBytes)[j] = d;
      } else {
        const int64_t r = c - wide * kWideChunks;
        uint8_t* step = lanes.row(m) + wide * kWideLaneBytes + r / 4 * kQuadLaneBytes;
        std::memcpy(step + (r % 4) * 16, block, 16);
        std::memcpy(step + kStepBytes + (r % 4) * 16, block + 16, 16);
        float* lane_d = reinterpret_cast<float*>(step + 2 * kStepBytes) + (r % 4) * 4;
        std::fill(lane_d, lane_d + 4, d);
      }
    }
  return lanes;
}

// int8: 64 bytes are 2 blocks in x's own order, then each block's d in its 8 int32 lanes.
constexpr int64_t kPairLaneBytes = kStepBytes + 64;

Int8Lanes int8_lanes(const Int8Rows& xq, int rows) {
  Int8Lanes lanes(rows, (xq.blocks + 1) / 2 * kPairLaneBytes);
  for (int m = 0; m < rows; ++m)
    for (int64_t b = 0; b < xq.blocks; ++b) {
      uint8_t* step = lanes.row(m) + b / 2 * kPairLaneBytes;
      std::memcpy(step + (b % 2) * kBlock, xq.q.data() + (m * xq.blocks + b) * kBlock, kBlock);
      float* d = reinterpret_cast<float*>(step + kStepBytes) + (b % 2) * 8;
      std::fill(d, d + 8, xq.scales[m * xq.blocks + b]);
    }
  return lanes;
}

inline __m512i load_operand(const uint8_t* p) {
  return _mm512_load_si512(reinterpret_cast<const __m512i*>(p));
}

inline __m512 load_lane_scales(const uint8_t* step, int64_t at) {
  return _mm512_load_ps(reinterpret_cast<const float*>(step + at));
}

// Lane i of a quad's dots belongs to chunk i / 4, whose group is (i / 4) >> group_shift
// groups past the quad's first (4l is a multiple of 4, so a quad starts on a group of up to
// 4 chunks and a bigger group spans whole quads): the vpermps index that spreads a quad's
// widened group scales over its lanes.
__m512i quad_scale_lanes(int group_shift) {
  alignas(64) int32_t index[16];
  for (int i = 0; i < 16; ++i) index[i] = (i / 4) >> group_shift;
  return _mm512_load_si512(index);
}

// The weight scales of quad l (chunks 4l..4l+3) of a row in their dots' lanes; `real` masks
// the groups the quad's chunks use (the rest read nothing).
inline __m512 quad_weight_scales(const at::Half* scales, int64_t l, int group_shift,
                                 __mmask8 real, __m512i lanes) {
  const __m128 widened = _mm_cvtph_ps(_mm_maskz_loadu_epi16(real, scales + ((4 * l) >> group_shift)));
  return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(widened));
}

// The groups (of up to 4 per quad) that `chunks` chunks of a quad use, as a load mask.
inline __mmask8 quad_groups(int64_t chunks, int group_shift) {
  return static_cast<__mmask8>((1u << (((chunks - 1) >> group_shift) + 1)) - 1);
}

inline float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }

// The scales of wide block k (chunks 16k..16k+15) of a row, chunk j's in lane j.
inline __m512 wide_weight_scales(const at::Half* scales, int64_t k, int group_shift,
                                 __m512i lanes) {
  const __m512 widened = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
      static_cast<__mmask16>((1u << (group_shift < 4 ? kWideChunks >> group_shift : 1)) - 1),
      scales + ((k * kWideChunks) >> group_shift)));
  return group_shift ? _mm512_permutexvar_ps(lanes, widened) : widened;
}

// The layout facts of one int4 layer that every row's dots use.
struct Int4Layout {
  int64_t chunks, groups, wide, tail_quads, tail_chunks;
  int group_shift;
  __mmask64 tail_bytes;
  __mmask8 full_groups, tail_groups;
  __m512i quad_lanes, wide_lanes;

  Int4Layout(int64_t in, int shift)
      : chunks(in / kChunk), groups(chunks >> shift), wide(chunks / kWideChunks),
        tail_quads(chunks % kWideChunks / 4), tail_chunks(chunks % 4), group_shift(shift),
        tail_bytes(tail_chunks ? ~0ull >> (64 - 16 * tail_chunks) : 0),
        full_groups(quad_groups(4, shift)),
        tail_groups(tail_chunks ? quad_groups(tail_chunks, shift) : 0),
        quad_lanes(quad_scale_lanes(shift)), wide_lanes(_mm512_srlv_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set1_epi32(shift))) {}
};

// One row of x's rounded values for the first wide block, the first tail quad and the first
// 16 groups' sums, held in registers across the output rows of a call: a 576-wide layer's
// whole x (14 vectors), so a row's loads are its weights only: with one row of x, x's
// operands from L1 were two of every three 64-byte loads. Together with the single weight
// load and the 16-row sums this took a 3072x576 layer, hot in the caches on the Zen 4, from
// 59 to 48 cycles per row (one thread).
struct HeldX {
  __m512i wide[8], quad[2];
  __m512 wide_scale, quad_scale, group_sums;
};

inline HeldX hold_x(const Int4Layout& layout, const uint8_t* x_row, const float* xsum) {
  HeldX held;
  for (int j = 0; j < 8; ++j)
    held.wide[j] = layout.wide ? load_operand(x_row + j * kStepBytes) : _mm512_setzero_si512();
  held.wide_scale = layout.wide ? load_lane_scales(x_row, 8 * kStepBytes) : _mm512_setzero_ps();
  const uint8_t* quad = x_row + layout.wide * kWideLaneBytes;
  const bool has_quad = layout.tail_quads || layout.tail_chunks;
  for (int j = 0; j < 2; ++j)
    held.quad[j] = has_quad ? load_operand(quad + j * kStepBytes) : _mm512_setzero_si512();
  held.quad_scale = has_quad ? load_lane_scales(quad, 2 * kStepBytes) : _mm512_setzero_ps();
  held.group_sums = _mm512_loadu_ps(xsum);
  return held;
}

// out[m] = lanes summing to output row n for M rows of x. Wide blocks: per 64-byte load
// the low nibbles (`& 0x0F`) and the high ones left in place (`& 0xF0`, 16 times their
// value: no shift) go into two vpdpbusd per row of x, each chunk's dot summing in its own
// int32 lane over the block's 4 loads; the high sums are multiples of 16, so `>> 4` takes
// the factor off exactly once per block. Then one convert and one fma with d_x * scale_w per
// 16 chunks. Tail quads: 4 chunks per load, a chunk's dot in 4 lanes.
// The offsets' term uses the rounded x's group sums (as llama.cpp's Q8_1 does), so the
// result is the rounded x's exact dot with the de-quantized weights: with x's own sums, the
// rounding would meet q * scale (0 to the group's range) instead of the weight itself
// (centred near zero), a several times larger error. The three terms (blocks, quads,
// offsets) run as separate chains and meet at the end.
// `held` (one row of x only): x's first block, quad and group sums already in registers.
template <int M>
inline void int4_dot_row(const Int4Layout& layout, const uint8_t* const (&x_rows)[M],
                         const float* xsum, const HeldX* held, const uint8_t* weight,
                         const at::Half* scales, const at::Half* offsets, int64_t n,
                         __m512 (&out)[M]) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F), high_nibbles = _mm512_set1_epi8(-16);
  const uint8_t* row = weight + n * layout.chunks * (kChunk / 2);
  const at::Half* row_scales = scales + n * layout.groups;
  __m512 acc[M], tail_acc[M];
  for (int m = 0; m < M; ++m) acc[m] = tail_acc[m] = _mm512_setzero_ps();
  // x_lane(m, j): operand j (of 8) of block k for row m of x; x_scale(m): its chunks' d.
  auto wide_block = [&](int64_t k, auto&& x_lane, auto&& x_scale)
                        __attribute__((always_inline)) {
    __m512i low_dots[M], high_dots[M];
    for (int m = 0; m < M; ++m) low_dots[m] = high_dots[m] = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) {
      __m512i packed = _mm512_loadu_si512(row + k * kWideBytes + t * kStepBytes);
      asm("" : "+v"(packed));  // one load for both nibble masks, not one folded into each
      const __m512i low = _mm512_and_si512(packed, low_nibbles);
      const __m512i high = _mm512_and_si512(packed, high_nibbles);
      for (int m = 0; m < M; ++m) {
        low_dots[m] = _mm512_dpbusd_epi32(low_dots[m], low, x_lane(m, 2 * t));
        high_dots[m] = _mm512_dpbusd_epi32(high_dots[m], high, x_lane(m, 2 * t + 1));
      }
    }
    const __m512 w_scale =
        wide_weight_scales(row_scales, k, layout.group_shift, layout.wide_lanes);
    for (int m = 0; m < M; ++m) {
      const __m512i dots = _mm512_add_epi32(low_dots[m], _mm512_srai_epi32(high_dots[m], 4));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(w_scale, x_scale(m)),
                               acc[m]);
    }
  };
  int64_t k = 0;
  if (held != nullptr && layout.wide) {
    wide_block(0, [&](int m, int j) { return held[m].wide[j]; },
               [&](int m) { return held[m].wide_scale; });
    k = 1;
  }
  for (; k < layout.wide; ++k)
    wide_block(k, [&](int m, int j) {
      return load_operand(x_rows[m] + k * kWideLaneBytes + j * kStepBytes);
    }, [&](int m) { return load_lane_scales(x_rows[m] + k * kWideLaneBytes, 8 * kStepBytes); });
  // The quads after the wide blocks, their scales from the first group past them.
  const uint8_t* tail = row + layout.wide * kWideBytes;
  const at::Half* tail_scales = row_scales + ((layout.wide * kWideChunks) >> layout.group_shift);
  auto add_quad = [&](int64_t l, __m512i packed, __mmask8 real_groups)
                      __attribute__((always_inline)) {
    const __m512i low = _mm512_and_si512(packed, low_nibbles);
    const __m512i high = _mm512_and_si512(packed, high_nibbles);
    const __m512 w_scale = quad_weight_scales(tail_scales, l, layout.group_shift, real_groups,
                                              layout.quad_lanes);
    for (int m = 0; m < M; ++m) {
      const uint8_t* step = x_rows[m] + layout.wide * kWideLaneBytes + l * kQuadLaneBytes;
      const bool in_registers = held != nullptr && l == 0;
      const __m512i x_low = in_registers ? held[m].quad[0] : load_operand(step);
      const __m512i x_high = in_registers ? held[m].quad[1] : load_operand(step + kStepBytes);
      const __m512 x_scale =
          in_registers ? held[m].quad_scale : load_lane_scales(step, 2 * kStepBytes);
      const __m512i dot = _mm512_add_epi32(
          _mm512_dpbusd_epi32(_mm512_setzero_si512(), low, x_low),
          _mm512_srai_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), high, x_high), 4));
      tail_acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(w_scale, x_scale),
                                    tail_acc[m]);
    }
  };
  for (int64_t l = 0; l < layout.tail_quads; ++l) {
    __m512i packed = _mm512_loadu_si512(tail + l * kStepBytes);
    asm("" : "+v"(packed));
    add_quad(l, packed, layout.full_groups);
  }
  if (layout.tail_chunks) {
    const int64_t l = layout.tail_quads;
    add_quad(l, _mm512_maskz_loadu_epi8(layout.tail_bytes, tail + l * kStepBytes),
             layout.tail_groups);
  }
  const int64_t groups = layout.groups;
  const at::Half* row_offsets = offsets + n * groups;
  for (int m = 0; m < M; ++m) {
    __m512 shift = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += 16)
      shift = _mm512_fmadd_ps(
          _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_lanes(groups - g), row_offsets + g)),
          held != nullptr && g == 0 ? held[m].group_sums
                                    : _mm512_loadu_ps(xsum + m * padded_groups(groups) + g),
          shift);
    out[m] = _mm512_add_ps(_mm512_add_ps(acc[m], tail_acc[m]), shift);
  }
}

// Weight bytes ahead of the row being dotted that one row of x requests with a software
// prefetch. With the hardware prefetchers alone, one thread streamed the default model's 120
// int4 layers from DRAM at ~16.5 GB/s against ~32 hot in the caches and ~25 for torch.sum's
// read: compute and memory took turns instead of overlapping. 4 KB ahead into L1 (14 rows of
// a 576-wide layer, 5 of the 1536-wide one) made it ~21 GB/s. Asking into L2 instead
// (kvscope::prefetch_to_l2: a core's few L1 miss buffers cap requests into L1) from 8 KB
// ahead took a one-token forward of that model, two threads, from 2.80-2.87 to 2.64-2.69 ms
// (in-process alternation, every round faster); into L2 from 4 KB gained little, and 6-12 KB
// measured alike. Prefetching the scales and offsets too was a little worse.
constexpr int64_t kPrefetchBytes = 8192;

// Rows x_first..x_first + M - 1 of x (xsum: theirs) against output rows [begin, end).
template <int M>
void int4_rows_vnni(const Int8Lanes& xl, int x_first, const float* xsum, int64_t in,
                    const uint8_t* weight, const at::Half* scales, const at::Half* offsets,
                    int group_shift, const bf16* bias, bf16* out, int64_t out_stride,
                    int64_t begin, int64_t end) {
  const Int4Layout layout(in, group_shift);
  const uint8_t* x_rows[M];
  for (int m = 0; m < M; ++m) x_rows[m] = xl.row(x_first + m);
  for (int64_t first = begin; first < end; first += kRowBlock) {
    const int64_t count = std::min(kRowBlock, end - first);
    __m512 lanes[M][kRowBlock];
    if constexpr (M == 1) {  // x's first parts in registers across the block's rows
      const HeldX held = hold_x(layout, x_rows[0], xsum);
      const int64_t row_bytes = layout.chunks * (kChunk / 2);
      const uint8_t* const last_byte = weight + end * row_bytes;
      for (int64_t i = 0; i < count; ++i) {
        // This row's bytes, kPrefetchBytes on: rows on rows, every line of [begin, end).
        const uint8_t* ahead = weight + (first + i) * row_bytes + kPrefetchBytes;
        for (const uint8_t* line = ahead; line < std::min(ahead + row_bytes, last_byte);
             line += 64)
          kvscope::prefetch_to_l2(line);
        __m512 row_lanes[1];
        int4_dot_row<1>(layout, x_rows, xsum, &held, weight, scales, offsets, first + i,
                        row_lanes);
        lanes[0][i] = row_lanes[0];
      }
    } else {
      for (int64_t i = 0; i < count; ++i) {
        __m512 row_lanes[M];
        int4_dot_row<M>(layout, x_rows, xsum, nullptr, weight, scales, offsets, first + i,
                        row_lanes);
        for (int m = 0; m < M; ++m) lanes[m][i] = row_lanes[m];
      }
    }
    alignas(64) float y[M][kRowBlock];
    for (int m = 0; m < M; ++m) {
      for (int64_t i = count; i < kRowBlock; ++i) lanes[m][i] = _mm512_setzero_ps();
      _mm512_store_ps(y[m], kvscope::sum_lanes_of_16(lanes[m]));
    }
    store_block<M>(out, out_stride, first, count, y, bias);
  }
}

// int8 rows with VNNI: vpdpbusd wants one unsigned operand, so the weights are flipped to
// u = q + 128 (one xor per 64 bytes) and the extra 128 * (x's rounded sum) comes off once
// per output: sum_b d_b * (u . q_x) = x . w + 128 * sum_b d_b * sum(q_x), the last
// independent of the weight row (scaled_q_sums).
template <int M, typename Out>
void int8_rows_vnni(const Int8Lanes& xl, int x_first, const float* q_sums, int64_t in,
                    const int8_t* weight, const float* scales, const bf16* bias, Out* out,
                    int64_t out_stride, int64_t begin, int64_t end) {
  const int64_t full = in / kStepBytes;
  const __mmask64 tail = in % kStepBytes ? (~0ull >> (64 - in % kStepBytes)) : 0;
  const __m512i flip = _mm512_set1_epi8(-128);
  const uint8_t* x_rows[M];
  for (int m = 0; m < M; ++m) x_rows[m] = xl.row(x_first + m);
  for (int64_t first = begin; first < end; first += kRowBlock) {
    const int64_t count = std::min(kRowBlock, end - first);
    float y[M][kRowBlock];
    for (int64_t i = 0; i < count; ++i) {
      const int8_t* row = weight + (first + i) * in;
      __m512 acc[M];
      for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
      // Bytes past `in` load as zeros and flip to 128, but their x is zero.
      auto add_pair = [&](int64_t l, __m512i w) __attribute__((always_inline)) {
        const __m512i u = _mm512_xor_si512(w, flip);
        for (int m = 0; m < M; ++m) {
          const uint8_t* step = x_rows[m] + l * kPairLaneBytes;
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, load_operand(step));
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), load_lane_scales(step, kStepBytes),
                                   acc[m]);
        }
      };
      for (int64_t l = 0; l < full; ++l) add_pair(l, _mm512_loadu_si512(row + l * kStepBytes));
      if (tail) add_pair(full, _mm512_maskz_loadu_epi8(tail, row + full * kStepBytes));
      for (int m = 0; m < M; ++m)
        y[m][i] = (reduce(acc[m]) - 128.f * q_sums[m]) * scales[first + i];
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

// All rows of x against the weights, tile by tile: each tile of kRowBlock output rows
// (at most 12 KB of int4, 24 KB of int8 for a 1536-wide layer) stays in L1 while every
// group of up to kMaxRows rows of x meets it, so a decode batch of any size reads the
// weights from memory once, with no de-quantized copy (the tile-fused GEMM of a few dozen
// rows). rows_kernel(M constant, x_first, begin, end) computes one group against output rows
// [begin, end), tile by tile; the threads take chunks of at least `min_rows` output rows.
template <typename RowsKernel>
void all_rows_by_tiles(int64_t rows, int64_t out_features, int64_t min_rows,
                       RowsKernel&& rows_kernel) {
  kvscope::parallel_for(0, out_features, min_rows, [&](int64_t begin, int64_t end) {
    // One group (a single stream's decode): the kernel walks the thread's whole share in one
    // call, setting its layout and held x up once rather than per tile (one thread, the
    // default model's 120 int4 layers hot in the caches: 13% less time).
    if (rows <= kMaxRows)
      return with_rows(static_cast<int>(rows), [&](auto rows_constant) {
        rows_kernel(rows_constant, 0, begin, end);
      });
    for (int64_t first = begin; first < end; first += kRowBlock) {
      const int64_t last = std::min(first + kRowBlock, end);
      for (int64_t x_first = 0; x_first < rows; x_first += kMaxRows)
        with_rows(static_cast<int>(std::min<int64_t>(kMaxRows, rows - x_first)),
                  [&](auto rows_constant) {
                    rows_kernel(rows_constant, static_cast<int>(x_first), first, last);
                  });
    }
  });
}

// Whether bf16 activations are rounded to int8 for VNNI dot products on this build.
bool rounds_activations_to_int8() {
#if defined(KVSCOPE_VNNI_DOTS)
  return true;
#else
  return false;
#endif
}

// The fewest output rows of an int4 layer per chunk of work. A single stream's layer goes
// one share per thread: its weights stream with a software prefetch kPrefetchBytes ahead
// within a chunk (int4_rows_vnni), so each chunk starts its stream cold, and the pool's four
// chunks per thread left the default model's 120 int4 layers at ~27 GB/s from DRAM with two
// threads against ~32 for a read of one buffer. A helper that has not started still leaves
// its share to the caller.
int64_t int4_chunk_rows(int64_t rows, int64_t out_features, int64_t row_bytes) {
  if (rows > kMaxRows) return grain(row_bytes);
  return std::max(grain(row_bytes), kvscope::one_share_per_thread(out_features));
}

template <typename T>
void int4_linear_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                      const at::Tensor& offsets, int64_t group_size, const T* bias,
                      at::Tensor& out) {
  const int64_t in = x.size(1), out_features = weight.size(0), groups = in / group_size;
  const int group_shift = __builtin_ctzll(group_size / kChunk);
#if defined(KVSCOPE_VNNI_DOTS)
  if constexpr (std::is_same_v<T, bf16>) {
    const int rows = static_cast<int>(x.size(0));
    const Int8Rows xq = quantize_rows(elements<T>(x), x.stride(0), rows, in);
    // The rounded x's group sums (for the offsets), zeros past `groups` (read as vectors).
    std::vector<float> xsum(rows * padded_groups(groups), 0.f);
    for (int m = 0; m < rows; ++m)
      for (int64_t c = 0; c < xq.blocks; ++c)
        xsum[m * padded_groups(groups) + (c >> group_shift)] += xq.block_sums[m * xq.blocks + c];
    const Int8Lanes xl = int4_lanes(xq, rows);
    all_rows_by_tiles(rows, out_features, int4_chunk_rows(rows, out_features, in / 2),
                      [&](auto rows_constant, int x_first, int64_t begin, int64_t end) {
      constexpr int M = decltype(rows_constant)::value;
      int4_rows_vnni<M>(xl, x_first, xsum.data() + x_first * padded_groups(groups), in,
                        weight.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                        offsets.data_ptr<at::Half>(), group_shift, bias,
                        elements<T>(out) + x_first * out.stride(0), out.stride(0), begin, end);
    });
    return;
  }
#endif
  for (int64_t first = 0; first < x.size(0); first += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, x.size(0) - first));
    const T* x_rows = elements<T>(x) + first * x.stride(0);
    T* y = elements<T>(out) + first * out.stride(0);
    // x's group sums (for the offsets), zeros past `groups` in each row (read as vectors).
    std::vector<float> xsum(rows * padded_groups(groups), 0.f);
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

// Out: T, or fp32 for bf16 T (see store_block).
template <typename T, typename Out>
void int8_linear_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                      const T* bias, at::Tensor& out) {
  const int64_t in = x.size(1), out_features = weight.size(0);
#if defined(KVSCOPE_VNNI_DOTS)
  if constexpr (std::is_same_v<T, bf16>) {
    const int rows = static_cast<int>(x.size(0));
    const Int8Rows xq = quantize_rows(elements<T>(x), x.stride(0), rows, in);
    const Int8Lanes xl = int8_lanes(xq, rows);
    all_rows_by_tiles(rows, out_features, grain(in), [&](auto rows_constant, int x_first,
                                                         int64_t begin, int64_t end) {
      constexpr int M = decltype(rows_constant)::value;
      int8_rows_vnni<M>(xl, x_first, xq.scaled_q_sums.data() + x_first, in,
                        weight.data_ptr<int8_t>(), scales.data_ptr<float>(), bias,
                        elements<Out>(out) + x_first * out.stride(0), out.stride(0), begin, end);
    });
    return;
  }
#endif
  for (int64_t first = 0; first < x.size(0); first += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, x.size(0) - first));
    const T* x_rows = elements<T>(x) + first * x.stride(0);
    Out* y = elements<Out>(out) + first * out.stride(0);
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


// widened_out: the op also writes bf16 x's result into an fp32 out.
void check_rows(const at::Tensor& x, const at::Tensor& weight, int64_t in,
                const std::optional<at::Tensor>& bias, const at::Tensor& out, const char* op,
                bool widened_out = false) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == in, op,
              ": x [rows, in] with contiguous features");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x float32 or bfloat16");
  TORCH_CHECK(weight.is_contiguous() && out.is_contiguous() && out.dim() == 2 &&
              out.size(0) == x.size(0) && out.size(1) == weight.size(0) &&
              (out.scalar_type() == x.scalar_type() ||
               (widened_out && out.scalar_type() == at::kFloat)),
              op, ": out [rows, out_features] of x's dtype",
              widened_out ? " (or float32)" : "");
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

// out = x @ (q * scale).T + bias with int8 q [out_features, in] and fp32 scale per row. out
// has x's dtype, or is fp32 for bf16 x (logits): the bf16 result widened, written directly.
void int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                 const std::optional<at::Tensor>& bias, at::Tensor out) {
  check_rows(x, weight, weight.size(1), bias, out, "int8_linear", /*widened_out=*/true);
  check_int8_weight(weight, scales, "int8_linear");
  if (x.scalar_type() == at::kFloat)
    int8_linear_impl<float, float>(x, weight, scales, bias_data<float>(bias), out);
  else if (out.scalar_type() == at::kFloat)
    int8_linear_impl<bf16, float>(x, weight, scales, bias_data<bf16>(bias), out);
  else
    int8_linear_impl<bf16, bf16>(x, weight, scales, bias_data<bf16>(bias), out);
}

namespace {

// Rows [begin, end) of weights, de-quantized (computed in fp32, rounded once to T).
template <typename T>
void int4_dequantize_rows(const uint8_t* weight, const at::Half* scales,
                          const at::Half* offsets, int64_t group_size, int64_t in, T* out,
                          int64_t begin, int64_t end) {
  const int64_t groups = in / group_size;
  std::vector<uint8_t> ordered(in / 2);
  for (int64_t n = begin; n < end; ++n) {
    gguf_order_row(weight + n * in / 2, in / kChunk, ordered.data());
    for (int64_t g = 0; g < groups; ++g) {
      const float s = static_cast<float>(scales[n * groups + g]);
      const float o = static_cast<float>(offsets[n * groups + g]);
      for (int64_t k = g * group_size; k < (g + 1) * group_size; k += kChunk) {
        const u8x16 packed = load_vector<u8x16>(ordered.data() + k / 2);
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
