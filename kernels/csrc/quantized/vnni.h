// The int8-dot path of the int4 and int8 linears, for bf16 activations on a CPU with
// AVX512-VNNI (Zen 4, Ice Lake and later), after llama.cpp: each row of x is rounded to int8
// once per call, with one scale per 32 values (Q8_0), and vpdpbusd multiplies 64 raw weight
// bytes by 64 of those per instruction, summing into int32; only the block sums are scaled
// in fp32. That rounding of the activations is the one approximation
// (tests/test_quantization.py bounds it). The code is VNNI's own instructions; results leave
// it as FP32Vec16 (vec.hpp).
#pragma once

// The build is -march=native (kernels/cpu_extension.py, cached per CPU), so these are the
// running CPU's own features; elsewhere the portable path (portable.h) compiles alone.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVSCOPE_VNNI_DOTS 1
#endif

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "quantized/common.h"

#if defined(KVSCOPE_VNNI_DOTS)
#include <immintrin.h>
#endif

namespace kvscope::quantized {

constexpr int64_t kBlock = 32;  // activations share one int8 scale per 32 values (Q8_0)

// Rows of bf16 x rounded to int8, llama.cpp's Q8_0: per block of 32 values d = max|x| / 127
// and q = round(x * (1 / d)), ties to even; values past `in` are zeros. The kernels read
// them re-laid for their weight layouts (int4_lanes, int8_lanes). (Defined on every CPU:
// kquants_dots.h rounds x so on AVX2 too.)
struct Int8Rows {
  int64_t blocks = 0;
  std::vector<int8_t> q;             // [rows][blocks * 32]
  std::vector<float> scales;         // [rows][blocks]: d
  std::vector<float> block_sums;     // [rows][blocks]: d * sum(q), the rounded block's sum
  std::vector<float> scaled_q_sums;  // per row: the rounded row's sum
};

#if defined(KVSCOPE_VNNI_DOTS)
inline __m512 load_bf16x16(const bf16* p, __mmask16 mask) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? 0xFFFF : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}

inline Int8Rows quantize_rows(const bf16* x, int64_t x_stride, int rows, int64_t in) {
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

inline Int8Lanes int4_lanes(const Int8Rows& xq, int rows) {
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

inline Int8Lanes int8_lanes(const Int8Rows& xq, int rows) {
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
inline __m512i quad_scale_lanes(int group_shift) {
  alignas(64) int32_t index[16];
  for (int i = 0; i < 16; ++i) index[i] = (i / 4) >> group_shift;
  return _mm512_load_si512(index);
}

// The weight scales of quad l (chunks 4l..4l+3) of a row in their dots' lanes; `real` masks
// the groups the quad's chunks use (the rest read nothing).
inline __m512 quad_weight_scales(const at::Half* scales, int64_t l, int group_shift, __mmask8 real,
                                 __m512i lanes) {
  const __m128 widened =
      _mm_cvtph_ps(_mm_maskz_loadu_epi16(real, scales + ((4 * l) >> group_shift)));
  return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(widened));
}

// The groups (of up to 4 per quad) that `chunks` chunks of a quad use, as a load mask.
inline __mmask8 quad_groups(int64_t chunks, int group_shift) {
  return static_cast<__mmask8>((1u << (((chunks - 1) >> group_shift) + 1)) - 1);
}

// The scales of wide block k (chunks 16k..16k+15) of a row, chunk j's in lane j.
inline __m512 wide_weight_scales(const at::Half* scales, int64_t k, int group_shift,
                                 __m512i lanes) {
  const __m512 widened = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
      static_cast<__mmask16>((1u << (group_shift < 4 ? kWideChunks >> group_shift : 1)) - 1),
      scales + ((k * kWideChunks) >> group_shift)));
  return group_shift ? _mm512_permutexvar_ps(lanes, widened) : widened;
}

// The layout facts of one int4 layer that every row's dots use. A row's nibbles start
// every `row_bytes` bytes: in / 2 for Int4Linear's weight, more where the row's scales
// follow its nibbles (Q4_K's and Q5_K's lanes, SuperBlockScales).
struct Int4Layout {
  int64_t chunks, groups, wide, tail_quads, tail_chunks, row_bytes;
  int group_shift;
  __mmask64 tail_bytes;
  __mmask8 full_groups, tail_groups;
  __m512i quad_lanes, wide_lanes;

  Int4Layout(int64_t in, int shift, int64_t stride)
      : chunks(in / kChunk),
        groups(chunks >> shift),
        wide(chunks / kWideChunks),
        tail_quads(chunks % kWideChunks / 4),
        tail_chunks(chunks % 4),
        row_bytes(stride),
        group_shift(shift),
        tail_bytes(tail_chunks ? ~0ull >> (64 - 16 * tail_chunks) : 0),
        full_groups(quad_groups(4, shift)),
        tail_groups(tail_chunks ? quad_groups(tail_chunks, shift) : 0),
        quad_lanes(quad_scale_lanes(shift)),
        wide_lanes(_mm512_srlv_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set1_epi32(shift))) {}
};

// Where the int4 dots' weight scales and offsets come from. `row(weight, n)` gives output
// row n's, whose `wide(k)` are the scales of wide block k's 16 chunks in their lanes,
// `quad(l, real)` those of tail quad l (`real` masks the groups its chunks use) and
// `offsets_from(g)` the offsets of groups g..g + 15 (zeros past the row's groups).
//
// A float16 scale and offset per group of 2^group_shift chunks, row n's `stride` halves
// after row n - 1's: Int4Linear's [out][groups] arrays, or each row's own after its quants
// (the 32-weight GGUF types' lanes, common.h). Where `offsets` is null, a group's offset is
// `offset_per_scale` times its scale, computed here (Q4_0's, Q5_0's and Q8_0's lanes).
struct HalfScales {
  static constexpr int kGroupsPerChunk = 1;
  const at::Half* scales;
  const at::Half* offsets;
  int64_t stride;
  const Int4Layout& layout;
  float offset_per_scale = 0.f;

  struct Row {
    const at::Half *scales, *offsets;
    float offset_per_scale;
    const Int4Layout& layout;

    __m512 wide(int64_t k) const {
      return wide_weight_scales(scales, k, layout.group_shift, layout.wide_lanes);
    }
    __m512 quad(int64_t l, __mmask8 real) const {
      const at::Half* tail = scales + ((layout.wide * kWideChunks) >> layout.group_shift);
      return quad_weight_scales(tail, l, layout.group_shift, real, layout.quad_lanes);
    }
    __m512 offsets_from(int64_t g) const {
      const __mmask16 real = first_lanes(layout.groups - g);
      if (offsets == nullptr)
        return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(real, scales + g)),
                             _mm512_set1_ps(offset_per_scale));
      return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(real, offsets + g));
    }
  };
  Row row(const uint8_t*, int64_t n) const {
    return {scales + n * stride, offsets ? offsets + n * stride : nullptr, offset_per_scale,
            layout};
  }
};

// Lanes 0..7 float16 p[0] widened, lanes 8..15 p[1] (p[1] read only where `both`).
inline __m512 eight_lanes_each(const at::Half* p, bool both) {
  const __m128 pair = _mm_cvtph_ps(_mm_maskz_loadu_epi16(both ? 3 : 1, p));
  return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                               _mm512_castps128_ps512(pair));
}

// Q4_K (kFive false) or Q5_K repacked into lanes (KLanesRow, common.h): group g's scale is
// d[g / 8] * sc[g] and its offset -dmin[g / 8] * m[g], computed in fp32 as the file's
// de-quantization computes them.
template <bool kFive>
struct SuperBlockScales {
  static constexpr int kGroupsPerChunk = 1;
  const Int4Layout& layout;

  struct Row : KLanesRow {
    const Int4Layout& layout;

    static __m512 bytes(const uint8_t* p, __mmask16 mask) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, p)));
    }
    // Wide block k: sub-blocks 16k..16k + 15, super-blocks 2k and 2k + 1.
    __m512 wide(int64_t k) const {
      return _mm512_mul_ps(bytes(sc + 16 * k, 0xFFFF), eight_lanes_each(d + 2 * k, true));
    }
    // The tail is one super-block (rows are whole super-blocks, 8 chunks), quad l its
    // sub-blocks 4l..4l + 3, each spread over its 4 lanes.
    __m512 quad(int64_t l, __mmask8) const {
      const int64_t g = layout.wide * kWideChunks + 4 * l;
      const __m512 four =
          _mm512_mul_ps(bytes(sc + g, 0xF), _mm512_set1_ps(static_cast<float>(d[g / 8])));
      return _mm512_permutexvar_ps(layout.quad_lanes, four);
    }
    __m512 offsets_from(int64_t g) const {
      const __mmask16 real = first_lanes(layout.groups - g);
      return _mm512_mul_ps(bytes(m + g, real),
                           -eight_lanes_each(dmin + g / 8, layout.groups - g > 8));
    }
  };
  Row row(const uint8_t* weight, int64_t n) const {
    return {KLanesRow(weight + n * layout.row_bytes, layout.chunks * kChunk, kFive), layout};
  }
};

// Q6_K's lanes (Q6LanesRow, common.h): a scale d * sc per 16 weights, two groups to a chunk,
// so `wide_halves(k)` / `quad_halves(l)` give the scales of the chunks' first 16 weights and
// of their last 16 apart, and the offsets -32 * d * sc are per group of 16 (kGroupsPerChunk).
struct Q6Scales {
  static constexpr int kGroupsPerChunk = 2;
  const Int4Layout& layout;

  struct Row : Q6LanesRow {
    const Int4Layout& layout;

    // 16 chunks' (first, last) 16 weights' int8 scales from 32 consecutive ones, widened.
    static std::pair<__m512, __m512> halves(const int8_t* sc, __mmask32 real) {
      const __m512i pairs = _mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi8(real, sc));
      return {_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pairs, 24), 24)),
              _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 24))};
    }
    // Wide block k: chunks 16k..16k + 15, super-blocks 2k and 2k + 1.
    std::pair<__m512, __m512> wide_halves(int64_t k) const {
      const auto [first, last] = halves(sc + 32 * k, ~0u);
      const __m512 d_lanes = eight_lanes_each(d + 2 * k, true);
      return {_mm512_mul_ps(first, d_lanes), _mm512_mul_ps(last, d_lanes)};
    }
    // The tail is one super-block (8 chunks); quad l its chunks 4l..4l + 3, each over 4 lanes.
    std::pair<__m512, __m512> quad_halves(int64_t l) const {
      const int64_t chunk = layout.wide * kWideChunks + 4 * l;
      const auto [first, last] = halves(sc + 2 * chunk, 0xFF);
      const __m512 d_lanes = _mm512_set1_ps(static_cast<float>(d[chunk / 8]));
      return {_mm512_mul_ps(_mm512_permutexvar_ps(layout.quad_lanes, first), d_lanes),
              _mm512_mul_ps(_mm512_permutexvar_ps(layout.quad_lanes, last), d_lanes)};
    }
    // Groups g..g + 15 of 16 weights: one super-block's.
    __m512 offsets_from(int64_t g) const {
      const __m512 scales = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g))));
      return _mm512_mul_ps(scales, _mm512_set1_ps(-32.f * static_cast<float>(d[g / 16])));
    }
  };
  Row row(const uint8_t* weight, int64_t n) const {
    return {Q6LanesRow(weight + n * layout.row_bytes, layout.chunks * kChunk), layout};
  }
};

// One row of x's rounded values for the first wide block, the first tail quad and the first
// 16 groups' sums, held in registers across the output rows of a call: a 576-wide layer's
// whole x (14 vectors), so a row's loads are its weights only (with one row of x, x's
// operands from L1 would be two of every three 64-byte loads).
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
// `scales`: HalfScales or SuperBlockScales. kBits: how the row's quants sit (kQuantBytes):
//   4  Int4Linear's nibbles, as above;
//   5  the same nibbles, then per 64-byte load of them two 64-bit masks of 5th bits (of the
//      weights in its bytes' low nibbles, then high ones'): both operands shifted down to
//      their 5-bit values, no `>> 4` after;
//   6  the nibbles, then their top bit pairs (common.h): both operands 6-bit values; a
//      chunk's low operand holds its first 16 weights, its high one its last 16, each 16
//      with a scale of its own (Q6Scales), so the two dots are scaled apart;
//   8  bytes (Q8_0's q + 128, unsigned as vpdpbusd takes them, their scale's offset
//      -128 * d taking the 128 * sum(x) off): a wide block's 16 chunks in 8 loads, load 2t
//      holding x's operand 2t's weights and 2t + 1 its; a quad's chunks' first 16 bytes,
//      then their last 16 (16 * chunks bytes on).
template <int kBits>
constexpr int64_t kQuantWideBytes = kBits == 8 ? 2 * kWideBytes : kWideBytes;

template <int M, int kBits, typename Scales>
inline void int4_dot_row(const Int4Layout& layout, const uint8_t* const (&x_rows)[M],
                         const float* xsum, const HeldX* held, const uint8_t* weight,
                         const Scales& scales, int64_t n, __m512 (&out)[M]) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F), high_nibbles = _mm512_set1_epi8(-16);
  const uint8_t* row = weight + n * layout.row_bytes;
  const uint8_t* fifth = row + layout.chunks * kChunk / 2;  // kBits 5: after the nibbles
  const typename Scales::Row row_scales = scales.row(weight, n);
  __m512 acc[M], tail_acc[M];
  for (int m = 0; m < M; ++m) acc[m] = tail_acc[m] = _mm512_setzero_ps();
  // 64-byte load i of a row's nibbles as its low and high operands.
  auto nibbles = [&](__m512i packed, int64_t i) __attribute__((always_inline)) {
    asm("" : "+v"(packed));  // one load for both nibble masks, not one folded into each
    __m512i low = _mm512_and_si512(packed, low_nibbles);
    if constexpr (kBits == 4) {
      return std::pair(low, _mm512_and_si512(packed, high_nibbles));
    } else if constexpr (kBits == 6) {
      // Each operand's top pairs moved to bits 4-5 of their bytes with bits 6-7 clear, then
      // one select (bits 0-3 from the nibbles, 4-7 from the tops) per operand; the bits the
      // 16-bit shifts carry across bytes land in bits 0-3, which the select drops.
      const __m512i tops = _mm512_loadu_si512(fifth + kStepBytes * (i >> 1));
      const __m512i low_tops = _mm512_and_si512(tops, _mm512_set1_epi8(0x33));
      const __m512i high_tops = _mm512_and_si512(tops, _mm512_set1_epi8(static_cast<char>(0xCC)));
      // An even load's pairs sit in bits 0-3 of the tops, an odd one's in bits 4-7.
      const bool odd = i & 1;
      auto above_nibble = [&](__m512i nibble_bytes, __m512i top_bytes) {
        constexpr int kNibbles = 0xF0, kTops = 0xCC, kMask = 0xAA;  // vpternlogd's operands
        return _mm512_ternarylogic_epi32(nibble_bytes, top_bytes, low_nibbles,
                                         (kNibbles & kMask) | (kTops & ~kMask & 0xFF));
      };
      return std::pair(
          above_nibble(packed, odd ? low_tops : _mm512_slli_epi16(low_tops, 4)),
          above_nibble(_mm512_srli_epi16(packed, 4),
                       odd ? _mm512_srli_epi16(high_tops, 2) : _mm512_slli_epi16(high_tops, 2)));
    } else {
      uint64_t low_bits, high_bits;
      std::memcpy(&low_bits, fifth + 16 * i, 8);
      std::memcpy(&high_bits, fifth + 16 * i + 8, 8);
      const __m512i sixteen = _mm512_set1_epi8(16);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
      return std::pair(_mm512_mask_add_epi8(low, _cvtu64_mask64(low_bits), low, sixteen),
                       _mm512_mask_add_epi8(high, _cvtu64_mask64(high_bits), high, sixteen));
    }
  };
  // acc + the dots scaled: one weight scale per chunk (high dots 16 times theirs for 4 bits),
  // or for 6 bits (Q6Scales) one per 16 weights, the first 16's and the last 16's.
  auto weigh = [&](__m512 acc, __m512i low_dots, __m512i high_dots, const auto& w_scale,
                   __m512 x_scale) __attribute__((always_inline)) {
    if constexpr (kBits == 6) {
      acc =
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(low_dots), _mm512_mul_ps(w_scale.first, x_scale), acc);
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(high_dots), _mm512_mul_ps(w_scale.second, x_scale),
                             acc);
    } else {
      const __m512i dots = kBits == 4 ? _mm512_add_epi32(low_dots, _mm512_srai_epi32(high_dots, 4))
                                      : _mm512_add_epi32(low_dots, high_dots);
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(w_scale, x_scale), acc);
    }
  };
  // x_lane(m, j): operand j (of 8) of block k for row m of x; x_scale(m): its chunks' d.
  auto wide_block = [&](int64_t k, auto&& x_lane, auto&& x_scale) __attribute__((always_inline)) {
    __m512i low_dots[M], high_dots[M];
    for (int m = 0; m < M; ++m) low_dots[m] = high_dots[m] = _mm512_setzero_si512();
    const uint8_t* block = row + k * kQuantWideBytes<kBits>;
    for (int t = 0; t < 4; ++t) {
      const auto [low, high] = kBits == 8
                                   ? std::pair(_mm512_loadu_si512(block + 2 * t * kStepBytes),
                                               _mm512_loadu_si512(block + (2 * t + 1) * kStepBytes))
                                   : nibbles(_mm512_loadu_si512(block + t * kStepBytes), 4 * k + t);
      for (int m = 0; m < M; ++m) {
        low_dots[m] = _mm512_dpbusd_epi32(low_dots[m], low, x_lane(m, 2 * t));
        high_dots[m] = _mm512_dpbusd_epi32(high_dots[m], high, x_lane(m, 2 * t + 1));
      }
    }
    const auto w_scale = [&] {
      if constexpr (kBits == 6)
        return row_scales.wide_halves(k);
      else
        return row_scales.wide(k);
    }();
    for (int m = 0; m < M; ++m)
      acc[m] = weigh(acc[m], low_dots[m], high_dots[m], w_scale, x_scale(m));
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
  const uint8_t* tail = row + layout.wide * kQuantWideBytes<kBits>;
  auto add_quad = [&](int64_t l, __mmask64 bytes, int64_t chunks, __mmask8 real_groups)
                      __attribute__((always_inline)) {
    const uint8_t* at = tail + l * kStepBytes * (kBits == 8 ? 2 : 1);
    const auto [low, high] = kBits == 8
                                 ? std::pair(_mm512_maskz_loadu_epi8(bytes, at),
                                             _mm512_maskz_loadu_epi8(bytes, at + 16 * chunks))
                                 : nibbles(_mm512_maskz_loadu_epi8(bytes, at), 4 * layout.wide + l);
    const auto w_scale = [&] {
      if constexpr (kBits == 6)
        return row_scales.quad_halves(l);
      else
        return row_scales.quad(l, real_groups);
    }();
    for (int m = 0; m < M; ++m) {
      const uint8_t* step = x_rows[m] + layout.wide * kWideLaneBytes + l * kQuadLaneBytes;
      const bool in_registers = held != nullptr && l == 0;
      const __m512i x_low = in_registers ? held[m].quad[0] : load_operand(step);
      const __m512i x_high = in_registers ? held[m].quad[1] : load_operand(step + kStepBytes);
      const __m512 x_scale =
          in_registers ? held[m].quad_scale : load_lane_scales(step, 2 * kStepBytes);
      tail_acc[m] =
          weigh(tail_acc[m], _mm512_dpbusd_epi32(_mm512_setzero_si512(), low, x_low),
                _mm512_dpbusd_epi32(_mm512_setzero_si512(), high, x_high), w_scale, x_scale);
    }
  };
  for (int64_t l = 0; l < layout.tail_quads; ++l) add_quad(l, ~0ull, 4, layout.full_groups);
  if (layout.tail_chunks)
    add_quad(layout.tail_quads, layout.tail_bytes, layout.tail_chunks, layout.tail_groups);
  // Each 16 groups' offsets once for every row of x (SuperBlockScales computes them).
  const int64_t groups = layout.groups * Scales::kGroupsPerChunk;
  __m512 shift[M];
  for (int m = 0; m < M; ++m) shift[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g += 16) {
    const __m512 offsets = row_scales.offsets_from(g);
    for (int m = 0; m < M; ++m)
      shift[m] = _mm512_fmadd_ps(offsets,
                                 held != nullptr && g == 0
                                     ? held[m].group_sums
                                     : _mm512_loadu_ps(xsum + m * padded_groups(groups) + g),
                                 shift[m]);
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_add_ps(_mm512_add_ps(acc[m], tail_acc[m]), shift[m]);
}

// Rows x_first..x_first + M - 1 of x (xsum: theirs) against output rows [begin, end).
template <int M, int kBits, typename Scales, typename Out>
void int4_rows_vnni(const Int8Lanes& xl, int x_first, const float* xsum, const Int4Layout& layout,
                    const uint8_t* weight, const Scales& scales, const bf16* bias, Out* out,
                    int64_t out_stride, int64_t begin, int64_t end) {
  const uint8_t* x_rows[M];
  for (int m = 0; m < M; ++m) x_rows[m] = xl.row(x_first + m);
  for (int64_t first = begin; first < end; first += kRowBlock) {
    const int64_t count = std::min(kRowBlock, end - first);
    FP32Vec16 lanes[M][kRowBlock];
    if constexpr (M == 1) {  // x's first parts in registers across the block's rows
      const HeldX held = hold_x(layout, x_rows[0], xsum);
      const int64_t row_bytes = layout.row_bytes;
      const uint8_t* const last_byte = weight + end * row_bytes;
      for (int64_t i = 0; i < count; ++i) {
        kvscope::prefetch_ahead(weight + (first + i) * row_bytes, row_bytes, last_byte);
        __m512 row_lanes[1];
        int4_dot_row<1, kBits>(layout, x_rows, xsum, &held, weight, scales, first + i, row_lanes);
        lanes[0][i] = row_lanes[0];
      }
    } else {
      for (int64_t i = 0; i < count; ++i) {
        __m512 row_lanes[M];
        int4_dot_row<M, kBits>(layout, x_rows, xsum, nullptr, weight, scales, first + i, row_lanes);
        for (int m = 0; m < M; ++m) lanes[m][i] = row_lanes[m];
      }
    }
    alignas(64) float y[M][kRowBlock];
    for (int m = 0; m < M; ++m) {
      for (int64_t i = count; i < kRowBlock; ++i) lanes[m][i] = FP32Vec16();
      vec::reduce_sum_16(lanes[m]).store(y[m]);
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
          acc[m] =
              _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), load_lane_scales(step, kStepBytes), acc[m]);
        }
      };
      for (int64_t l = 0; l < full; ++l) add_pair(l, _mm512_loadu_si512(row + l * kStepBytes));
      if (tail) add_pair(full, _mm512_maskz_loadu_epi8(tail, row + full * kStepBytes));
      for (int m = 0; m < M; ++m)
        y[m][i] = (FP32Vec16(acc[m]).reduce_sum() - 128.f * q_sums[m]) * scales[first + i];
    }
    store_block<M>(out, out_stride, first, count, y, bias);
  }
}

// Bytes of rounded x rows a thread holds in L2 while its whole share of the weights passes
// them: a prefill of thousands of rows would otherwise stream x from memory once per tile.
constexpr int64_t kHeldXBytes = 1 << 20;

// All rows of x against the weights, tile by tile: each tile of kRowBlock output rows
// (at most 12 KB of int4, 24 KB of int8 for a 1536-wide layer) stays in L1 while every
// group of up to kMaxRows rows of x meets it, so a decode batch of any size reads the
// weights from memory once, with no de-quantized copy (the tile-fused GEMM of a few dozen
// rows). More rows than kHeldXBytes of x (x_row_bytes each) go span by span, each span
// meeting the thread's whole share of the weights, which then stream once per span.
// rows_kernel(M constant, x_first, begin, end) computes one group against output rows
// [begin, end), tile by tile; the threads take chunks of at least `min_rows` output rows.
template <typename RowsKernel>
void all_rows_by_tiles(int64_t rows, int64_t x_row_bytes, int64_t out_features, int64_t min_rows,
                       RowsKernel&& rows_kernel) {
  const int64_t span = std::max<int64_t>(kMaxRows, kHeldXBytes / x_row_bytes / kMaxRows * kMaxRows);
  kvscope::parallel_for(0, out_features, min_rows, [&](int64_t begin, int64_t end) {
    // One group (a single stream's decode): the kernel walks the thread's whole share in one
    // call, setting its layout and held x up once rather than per tile.
    if (rows <= kMaxRows)
      return with_rows<kMaxRows>(static_cast<int>(rows), [&](auto rows_constant) {
        rows_kernel(rows_constant, 0, begin, end);
      });
    for (int64_t span_first = 0; span_first < rows; span_first += span) {
      const int64_t span_end = std::min(span_first + span, rows);
      for (int64_t first = begin; first < end; first += kRowBlock) {
        const int64_t last = std::min(first + kRowBlock, end);
        by_row_groups<kMaxRows>(span_end - span_first, [&](auto count, int64_t x_first) {
          rows_kernel(count, static_cast<int>(span_first + x_first), first, last);
        });
      }
    }
  });
}

// out = x @ W.T + bias for bf16 x rounded to int8 and weights of `layout` whose quants sit
// as kBits says (int4_dot_row) and whose scales come from `scales` (HalfScales,
// SuperBlockScales): all rows of x against the weights, tile by tile. An fp32 out (the
// logits) takes the bf16-rounded results widened as they are stored: ATen's copy of a
// vocabulary-wide row would wake OpenMP's sleeping threads every step.
template <int kBits, typename Scales>
void int4_linear_vnni(const at::Tensor& x, const uint8_t* weight, int64_t out_features,
                      const Int4Layout& layout, const Scales& scales, const bf16* bias,
                      at::Tensor& out) {
  const int rows = static_cast<int>(x.size(0));
  const Int8Rows xq = quantize_rows(elements<bf16>(x), x.stride(0), rows, x.size(1));
  // The rounded x's group sums (for the offsets), zeros past the groups (read as vectors).
  const int64_t padded = padded_groups(layout.groups * Scales::kGroupsPerChunk);
  std::vector<float> xsum(rows * padded, 0.f);
  for (int m = 0; m < rows; ++m)
    for (int64_t c = 0; c < xq.blocks; ++c) {
      const int64_t at = m * xq.blocks + c;
      if constexpr (Scales::kGroupsPerChunk == 2) {  // per 16 values: each chunk's halves
        for (int h = 0; h < 2; ++h) {
          int sum = 0;
          for (int i = 0; i < 16; ++i) sum += xq.q[at * kBlock + 16 * h + i];
          xsum[m * padded + 2 * c + h] = xq.scales[at] * static_cast<float>(sum);
        }
      } else {
        xsum[m * padded + (c >> layout.group_shift)] += xq.block_sums[at];
      }
    }
  const Int8Lanes xl = int4_lanes(xq, rows);
  with_out_dtype(out, "int4_linear_vnni", [&](auto* y) {
    all_rows_by_tiles(rows, xl.row_bytes, out_features,
                      int4_chunk_rows(rows, out_features, layout.row_bytes),
                      [&](auto rows_constant, int x_first, int64_t begin, int64_t end) {
      constexpr int M = decltype(rows_constant)::value;
      int4_rows_vnni<M, kBits>(xl, x_first, xsum.data() + x_first * padded, layout, weight, scales,
                               bias, y + x_first * out.stride(0), out.stride(0), begin, end);
    });
  });
}

#endif  // KVSCOPE_VNNI_DOTS

}  // namespace kvscope::quantized
