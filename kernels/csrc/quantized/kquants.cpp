// gguf_linear and gguf_dequantize: linears over a GGUF tensor's blocks exactly as the file
// stores them (ggml's layouts: ggml-common.h), so a Q4_K_M model takes its file's size in
// memory. The weight is uint8 [out_features, row bytes], one row of blocks per output row;
// the block type is ggml's type id (GGMLQuantizationType).
//
//   Q4_0  32 weights, 18 bytes: d (f16), 16 bytes of nibbles; w = d * (q - 8)
//   Q4_1  32 weights, 20 bytes: d, m (f16), nibbles; w = d * q + m
//   Q5_0  32 weights, 22 bytes: d, 4 bytes of 5th bits, nibbles; w = d * (q - 16)
//   Q5_1  32 weights, 24 bytes: d, m, 5th bits, nibbles; w = d * q + m
//   Q8_0  32 weights, 34 bytes: d, 32 int8; w = d * q
//   Q4_K  256 weights, 144 bytes: d, dmin (f16), 12 bytes of 6-bit scales and mins for 8
//         sub-blocks of 32, 128 bytes of nibbles; w = d * sc * q - dmin * m
//   Q5_K  256 weights, 176 bytes: as Q4_K with 32 bytes of 5th bits before the nibbles
//   Q6_K  256 weights, 210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16
//         int8 scales (one per 16 weights), d (f16); w = d * sc * (q - 32)
//
// and kvscope's own lanes of each (type 100 + its type; common.h): rows repacked at load for
// the int4 kernels' dots, which take 16 chunks per 64-byte load where the blocks' dots take
// one (Q4_0..Q8_0) or a super-block's 8 in four (the k-quants): on a CPU with AVX512-VNNI they
// stream a model's layers faster at every row count measured (docs/performance-history.md, 'Lanes:
// every GGUF type repacked at load for the int4 kernels').
//
// Nibble order (every type): byte j of a 32-weight run holds weight j low and weight j + 16
// high (Q4_0..Q5_1); for the k-quants, each 32 bytes of nibbles hold 64 weights, the low
// nibbles the first 32.
//
// The exact path de-quantizes each output row's blocks to fp32 once, into a buffer that stays
// in L1 while every row of x is dotted with it (x widened to fp32 once per call): one read of
// the weights for any number of rows, the same exact result for every row. bf16 x takes
// integer dots instead, with x rounded to int8 (llama.cpp's q8_K / Q8_0): kquants_dots.h's,
// on a CPU with AVX512-VNNI or with AVX2 alone; they too read each
// row once for any number of rows. More rows than the model's streaming limit
// (engine/worker/models/quantized.py) run a GEMM over gguf_dequantize's dense weight instead.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_ops.h"
#include "quantized/common.h"
#include "quantized/kquants_blocks.h"
#include "quantized/kquants_dots.h"
#include "work_pool.h"

#if defined(KVSCOPE_VNNI_DOTS) || defined(KVSCOPE_AVX2_DOTS)
#define KVSCOPE_GGUF_INT8_DOTS 1
#endif

namespace kvscope::quantized {
namespace {

// ggml's type ids (ggml.h's enum ggml_type; the gguf package's GGMLQuantizationType).
enum GgmlType : int64_t {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
};

// The ggml type whose lanes (common.h) `type` is, or -1.
inline int64_t lanes_of(int64_t type) {
  const int64_t of = type - kLanesCode;
  return of == kQ4_0 || of == kQ4_1 || of == kQ5_0 || of == kQ5_1 || of == kQ8_0 || of == kQ4_K ||
                 of == kQ5_K || of == kQ6_K
             ? of
             : -1;
}

// Bits per quant of a ggml type's lanes.
inline int lanes_bits(int64_t of) {
  return of == kQ8_0 ? 8 : of == kQ6_K ? 6 : (of == kQ5_0 || of == kQ5_1 || of == kQ5_K) ? 5 : 4;
}

struct BlockFormat {
  int64_t weights, bytes;
};

std::optional<BlockFormat> block_format(int64_t type) {
  switch (type) {
    case kQ4_0:
      return BlockFormat{32, 18};
    case kQ4_1:
      return BlockFormat{32, 20};
    case kQ5_0:
      return BlockFormat{32, 22};
    case kQ5_1:
      return BlockFormat{32, 24};
    case kQ8_0:
      return BlockFormat{32, 34};
    case kQ4_K:
      return BlockFormat{256, 144};
    case kQ5_K:
      return BlockFormat{256, 176};
    case kQ6_K:
      return BlockFormat{256, 210};
    default:
      break;
  }
  // Lanes: their quants and scales per weight block (a row's bytes: row_bytes).
  const int64_t of = lanes_of(type);
  if (of < 0) return std::nullopt;
  const int64_t weights = of == kQ4_K || of == kQ5_K || of == kQ6_K ? kSuperBlock : 32;
  const int64_t scales = of == kQ6_K                    ? 16 + 2
                         : of == kQ4_K || of == kQ5_K   ? 16 + 4
                         : kquants::block32_has_min(of) ? 4
                                                        : 2;
  return BlockFormat{weights, weights / 8 * lanes_bits(of) + scales};
}

// A row's bytes: `in / weights` blocks, or a row of lanes, whose 5th bits come per load.
int64_t row_bytes(int64_t type, BlockFormat format, int64_t in) {
  const int64_t of = lanes_of(type);
  if (of < 0) return in / format.weights * format.bytes;
  return lanes_quant_bytes(lanes_bits(of), in) +
         in / format.weights * (format.bytes - format.weights / 8 * lanes_bits(of));
}

inline float half_at(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// 16 bytes' nibbles, low or high, as fp32 lanes.
inline FP32Vec16 low_nibbles(const uint8_t* p) {
  return FP32Vec16::widen(vec::U8Vec16::load(p) & 15);
}
inline FP32Vec16 high_nibbles(const uint8_t* p) {
  return FP32Vec16::widen(vec::U8Vec16::load(p) >> 4);
}

// Bits `first`..`first + 15` of a 32-bit word as 0.0 / 16.0 per lane (Q5_0 / Q5_1's 5th bits).
inline FP32Vec16 fifth_bits(uint32_t bits, int first) {
  const vec::u32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const vec::u32x16 shifted = (vec::u32x16{} + (bits >> first)) >> lane;
  return __builtin_convertvector((vec::i32x16)(shifted & 1), vec::f32x16) * 16.f;
}

// Sub-block j's 6-bit scale and min of a Q4_K / Q5_K block (ggml's get_scale_min_k4).
inline void scale_min(const uint8_t* q, int j, float& sc, float& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One block's weights in fp32, in x's order: (d * sc) * q - (dmin * m) and the like, the
// order the gguf package's reference de-quantization computes in.
void dequantize_block(int64_t type, const uint8_t* b, float* y) {
  switch (type) {
    case kQ4_0:
    case kQ4_1: {
      const FP32Vec16 d(half_at(b));
      const FP32Vec16 m(type == kQ4_1 ? half_at(b + 2) : -8.f * half_at(b));
      const uint8_t* qs = b + (type == kQ4_1 ? 4 : 2);
      (low_nibbles(qs) * d + m).store(y);
      (high_nibbles(qs) * d + m).store(y + 16);
      return;
    }
    case kQ5_0:
    case kQ5_1: {
      const float scale = half_at(b);
      const FP32Vec16 d(scale), m(type == kQ5_1 ? half_at(b + 2) : -16.f * scale);
      const uint8_t* qh = b + (type == kQ5_1 ? 4 : 2);
      uint32_t bits;
      std::memcpy(&bits, qh, 4);
      const uint8_t* qs = qh + 4;
      ((low_nibbles(qs) + fifth_bits(bits, 0)) * d + m).store(y);
      ((high_nibbles(qs) + fifth_bits(bits, 16)) * d + m).store(y + 16);
      return;
    }
    case kQ8_0: {
      const FP32Vec16 d(half_at(b));
      const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
      (FP32Vec16::widen(qs) * d).store(y);
      (FP32Vec16::widen(qs + 16) * d).store(y + 16);
      return;
    }
    case kQ4_K:
    case kQ5_K: {
      const float d = half_at(b), dmin = half_at(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;  // Q5_K only
      const uint8_t* qs = b + (type == kQ5_K ? 48 : 16);
      for (int j = 0; j < 8; ++j) {  // sub-block j: nibbles of bytes 32 * (j / 2)..
        float sc, m;
        scale_min(scales, j, sc, m);
        const FP32Vec16 scale(d * sc), shift(dmin * m);
        const uint8_t* q = qs + 32 * (j / 2);
        for (int h = 0; h < 2; ++h) {
          FP32Vec16 w = j % 2 ? high_nibbles(q + 16 * h) : low_nibbles(q + 16 * h);
          if (type == kQ5_K)  // bit j of the 5th-bit bytes
            w = w + FP32Vec16::widen((vec::U8Vec16::load(qh + 16 * h) >> j) & 1) * 16.f;
          (w * scale - shift).store(y + 32 * j + 16 * h);
        }
      }
      return;
    }
    case kQ6_K: {
      const float d = half_at(b + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      for (int half = 0; half < 2; ++half) {  // 128 weights from 64 ql and 32 qh bytes
        const uint8_t* ql = b + 64 * half;
        const uint8_t* qh = b + 128 + 32 * half;
        for (int part = 0; part < 4; ++part)  // weights 32 * part.. of this half
          for (int h = 0; h < 2; ++h) {
            const uint8_t* low = ql + 32 * (part % 2) + 16 * h;
            const FP32Vec16 nibble = part < 2 ? low_nibbles(low) : high_nibbles(low);
            const FP32Vec16 top =
                FP32Vec16::widen((vec::U8Vec16::load(qh + 16 * h) >> (2 * part)) & 3);
            const FP32Vec16 scale(d * sc[8 * half + 2 * part + h]);
            (scale * (nibble + top * 16.f - FP32Vec16(32.f)))
                .store(y + 128 * half + 32 * part + 16 * h);
          }
      }
      return;
    }
  }
}

// A row of lanes' quants (common.h) in x's order, as bytes: 4 to 6 bits as they are, 8 bits
// as q + 128 (the offsets carry the -128). Whole words moved, no arithmetic per weight:
// a GEMM of many rows de-quantizes every weight of the model each step.
void lanes_quants(const uint8_t* row, int64_t in, int bits, uint8_t* q) {
  const int64_t chunks = in / kChunk, wide = chunks / kWideChunks, tail = chunks % kWideChunks;
  if (bits == 8) {
    // Wide block k's load 2t + h holds bytes 16h + 4t..+3 of its chunk j in lane j.
    for (int64_t k = 0; k < wide; ++k)
      for (int64_t j = 0; j < kWideChunks; ++j)
        for (int64_t load = 0; load < 8; ++load)
          std::memcpy(q + (k * kWideChunks + j) * kChunk + 16 * (load % 2) + 4 * (load / 2),
                      row + (8 * k + load) * kStepBytes + 4 * j, 4);
    // Each quad's chunks' first 16 bytes, then their last 16.
    for (int64_t r = 0; r < tail; ++r) {
      const int64_t quad = r / 4, in_quad = std::min<int64_t>(4, tail - 4 * quad);
      const uint8_t* first = row + (8 * wide + 2 * quad) * kStepBytes + 16 * (r % 4);
      uint8_t* chunk = q + (wide * kWideChunks + r) * kChunk;
      std::memcpy(chunk, first, 16);
      std::memcpy(chunk + 16, first + 16 * in_quad, 16);
    }
    return;
  }
  // Each nibble byte's bits above 4: for its low nibble's weight in the low `width` bits,
  // for its high one's above them, per 64-byte load of nibbles; then both in chunk order.
  const int width = bits - 4;
  thread_local std::vector<uint8_t> nibbles, tops, ordered_tops;
  nibbles.resize(in / 2);
  gguf_order_row(row, chunks, nibbles.data());
  if (width > 0) {
    tops.resize(in / 2);
    ordered_tops.resize(in / 2);
    const uint8_t* above = row + in / 2;
    for (int64_t load = 0; 64 * load < in / 2; ++load) {
      const int64_t bytes = std::min<int64_t>(64, in / 2 - 64 * load);
      uint8_t* out = tops.data() + 64 * load;
      if (bits == 5) {  // two 64-bit masks per load: low nibbles' 5th bits, high ones'
        uint64_t low, high;
        std::memcpy(&low, above + 16 * load, 8);
        std::memcpy(&high, above + 16 * load + 8, 8);
        for (int64_t at = 0; at < bytes; ++at)
          out[at] = static_cast<uint8_t>(((low >> at) & 1) | ((high >> at) & 1) << 1);
      } else {  // bit pairs: loads 2u and 2u + 1 in the low and high nibbles of 64 bytes
        const uint8_t* pairs = above + 64 * (load / 2);
        const int shift = 4 * (load % 2);
        for (int64_t at = 0; at < bytes; ++at) out[at] = (pairs[at] >> shift) & 15;
      }
    }
    gguf_order_row(tops.data(), chunks, ordered_tops.data());
  }
  const uint8_t mask = static_cast<uint8_t>((1 << width) - 1);
  for (int64_t c = 0; c < chunks; ++c) {  // byte b: weight b's low nibble, weight b + 16's high
    const vec::U8Vec16 packed = vec::U8Vec16::load(nibbles.data() + 16 * c);
    vec::U8Vec16 low = packed & 15, high = packed >> 4;
    if (width > 0) {
      const vec::U8Vec16 top = vec::U8Vec16::load(ordered_tops.data() + 16 * c);
      low = low | ((top & mask) << 4);
      high = high | ((top >> width) << 4);
    }
    low.store(q + c * kChunk);
    high.store(q + c * kChunk + 16);
  }
}

// A row of lanes in fp32, x's order: q * scale + offset as one fma of exact products, the
// file's values bit for bit.
void dequantize_lanes_row(const uint8_t* row, int64_t in, int64_t of, float* y) {
  thread_local std::vector<uint8_t> q;
  q.resize(in);
  lanes_quants(row, in, lanes_bits(of), q.data());
  const bool k4 = of == kQ4_K || of == kQ5_K;
  const float offset_per_scale = kquants::block32_offset_per_d(of);  // 0: the row stores m
  const KLanesRow k(row, in, of == kQ5_K);
  const Q6LanesRow q6(row, in);
  const at::Half* scales =
      reinterpret_cast<const at::Half*>(row + lanes_quant_bytes(lanes_bits(of), in));
  for (int64_t h = 0; h < in / 16; ++h) {  // 16 weights at a time, chunk g = h / 2's
    const int64_t g = h / 2;
    float scale, offset;
    if (of == kQ6_K) {
      scale = static_cast<float>(q6.d[h / 16]) * q6.sc[h];
      offset = -32.f * scale;
    } else if (k4) {
      scale = static_cast<float>(k.d[g / 8]) * k.sc[g];
      offset = -(static_cast<float>(k.dmin[g / 8]) * k.m[g]);
    } else {
      scale = scales[g];
      offset = offset_per_scale != 0.f ? offset_per_scale * scale
                                       : static_cast<float>(scales[in / kChunk + g]);
    }
    vec::fma(FP32Vec16::widen(vec::U8Vec16::load(q.data() + 16 * h)), FP32Vec16(scale),
             FP32Vec16(offset))
        .store(y + 16 * h);
  }
}

void dequantize_row(int64_t type, BlockFormat format, const uint8_t* row, int64_t in, float* y) {
  // A row of lanes is no run of independent blocks.
  if (const int64_t of = lanes_of(type); of >= 0) return dequantize_lanes_row(row, in, of, y);
  for (int64_t k = 0; k < in / format.weights; ++k)
    dequantize_block(type, row + k * format.bytes, y + k * format.weights);
}

#if defined(KVSCOPE_GGUF_INT8_DOTS)
// bf16 x rounded to int8 (kquants_dots.h), each weight row dotted with every row of x while
// it is in L1, kMaxRows rows of x at a time: dot(rows constant, x_first, row, sums).
template <typename Out, typename Dot>
void linear_int8(const at::Tensor& weight, int64_t rows, const bf16* bias, at::Tensor& out,
                 Dot&& dot) {
  const int64_t out_features = weight.size(0), row_bytes = weight.size(1),
                out_stride = out.stride(0);
  const uint8_t* blocks = weight.data_ptr<uint8_t>();
  Out* y = elements<Out>(out);
  constexpr bf16* precision = nullptr;
  kvscope::parallel_for(0, out_features, int4_chunk_rows(rows, out_features, row_bytes),
                        [&](int64_t begin, int64_t end) {
    const uint8_t* const last_byte = blocks + end * row_bytes;
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = blocks + n * row_bytes;
      kvscope::prefetch_ahead(row, row_bytes, last_byte);
      const float b = bias != nullptr ? load(bias[n]) : 0.f;
      by_row_groups<kMaxRows>(rows, [&](auto count, int64_t first) {
        constexpr int R = decltype(count)::value;
        float sums[R];
        dot(count, static_cast<int>(first), row, sums);
        for (int m = 0; m < R; ++m)
          store(y[(first + m) * out_stride + n], round_to(sums[m] + b, precision));
      });
    }
  });
}

template <typename Out>
void gguf_linear_int8(const at::Tensor& x, const at::Tensor& weight, int64_t type, const bf16* bias,
                      at::Tensor& out) {
  const int64_t in = x.size(1), rows = x.size(0);
  const bf16* xb = elements<bf16>(x);
  if (type == kQ4_K || type == kQ5_K || type == kQ6_K) {
    const kquants::SuperRows xq =
        kquants::quantize_super_rows(xb, x.stride(0), static_cast<int>(rows), in, type != kQ6_K);
    return linear_int8<Out>(weight, rows, bias, out,
                            [&](auto rows_constant, int first, const uint8_t* row, auto& sums) {
      constexpr int R = decltype(rows_constant)::value;
      if (type == kQ6_K) return kquants::q6_dot<R>(xq, first, row, sums);
      if (type == kQ5_K) return kquants::k4_dot<R, true>(xq, first, row, sums);
      kquants::k4_dot<R, false>(xq, first, row, sums);
    });
  }
  const Int8Rows xq = quantize_rows(xb, x.stride(0), static_cast<int>(rows), in);
  linear_int8<Out>(weight, rows, bias, out,
                   [&](auto rows_constant, int first, const uint8_t* row, auto& sums) {
    constexpr int R = decltype(rows_constant)::value;
    switch (type) {
      case kQ4_0:
        return kquants::block32_dot<R, kQ4_0>(xq, first, row, sums);
      case kQ4_1:
        return kquants::block32_dot<R, kQ4_1>(xq, first, row, sums);
      case kQ5_0:
        return kquants::block32_dot<R, kQ5_0>(xq, first, row, sums);
      case kQ5_1:
        return kquants::block32_dot<R, kQ5_1>(xq, first, row, sums);
      default:
        return kquants::block32_dot<R, kQ8_0>(xq, first, row, sums);
    }
  });
}
#endif

#if defined(KVSCOPE_VNNI_DOTS)
// bf16 x against a row of lanes of ggml type `of` (common.h), through the int4 kernels.
void lanes_linear(const at::Tensor& x, const at::Tensor& weight, int64_t of,
                  const Int4Layout& layout, const bf16* bias, at::Tensor& out) {
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const int64_t rows = weight.size(0), in = x.size(1), groups = in / kChunk;
  if (of == kQ4_K)
    return int4_linear_vnni<4>(x, w, rows, layout, SuperBlockScales<false>{layout}, bias, out);
  if (of == kQ5_K)
    return int4_linear_vnni<5>(x, w, rows, layout, SuperBlockScales<true>{layout}, bias, out);
  if (of == kQ6_K) return int4_linear_vnni<6>(x, w, rows, layout, Q6Scales{layout}, bias, out);
  const int bits = lanes_bits(of);
  const at::Half* scales = reinterpret_cast<const at::Half*>(w + lanes_quant_bytes(bits, in));
  const float offset_per_scale = kquants::block32_offset_per_d(of);
  const HalfScales inline_scales{scales, offset_per_scale != 0.f ? nullptr : scales + groups,
                                 layout.row_bytes / 2, layout, offset_per_scale};
  if (bits == 8) return int4_linear_vnni<8>(x, w, rows, layout, inline_scales, bias, out);
  if (bits == 5) return int4_linear_vnni<5>(x, w, rows, layout, inline_scales, bias, out);
  int4_linear_vnni<4>(x, w, rows, layout, inline_scales, bias, out);
}
#endif

template <typename T, typename Out>
void gguf_linear_impl(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                      BlockFormat format, const T* bias, at::Tensor& out) {
#if defined(KVSCOPE_VNNI_DOTS)
  if constexpr (std::is_same_v<T, bf16>)
    if (const int64_t of = lanes_of(type); of >= 0) {
      const Int4Layout layout(x.size(1), 0, weight.size(1));
      return lanes_linear(x, weight, of, layout, bias, out);
    }
#endif
#if defined(KVSCOPE_GGUF_INT8_DOTS)
  if constexpr (std::is_same_v<T, bf16>)
    if (lanes_of(type) < 0) return gguf_linear_int8<Out>(x, weight, type, bias, out);
#endif
  const int64_t in = x.size(1), out_features = weight.size(0), rows = x.size(0);
  const int64_t row_bytes = weight.size(1), out_stride = out.stride(0);
  const std::vector<float> xf = widen_rows(elements<T>(x), x.stride(0), rows, in);
  const uint8_t* blocks = weight.data_ptr<uint8_t>();
  Out* y = elements<Out>(out);
  constexpr T* precision = nullptr;
  kvscope::parallel_for(0, out_features, grain(row_bytes), [&](int64_t begin, int64_t end) {
    std::vector<float> w(in);
    for (int64_t n = begin; n < end; ++n) {
      dequantize_row(type, format, blocks + n * row_bytes, in, w.data());
      const float b = bias != nullptr ? load(bias[n]) : 0.f;
      by_row_groups<kMaxRows>(rows, [&](auto count, int64_t first) {
        constexpr int R = decltype(count)::value;
        float sums[R];
        vec::dot_rows<R>(xf.data() + first * in, in, w.data(), in, sums);
        for (int m = 0; m < R; ++m)
          store(y[(first + m) * out_stride + n], round_to(sums[m] + b, precision));
      });
    }
  });
}

BlockFormat check_gguf_weight(const at::Tensor& weight, int64_t type, int64_t in, const char* op) {
  const std::optional<BlockFormat> format = block_format(type);
  TORCH_CHECK(format.has_value(), op, ": ggml type ", type,
              " is not one of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (or ", kLanesCode,
              " + one of them: kvscope's lanes of it)");
  TORCH_CHECK(in % format->weights == 0, op, ": in (", in, ") a multiple of the block's ",
              format->weights, " weights");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) == row_bytes(type, *format, in),
              op, ": weight uint8 [out_features, in / ", format->weights, " * ", format->bytes,
              lanes_of(type) >= 0 ? " (lanes: with 5th bits per 64-byte load)" : "", "]");
  return *format;
}

}  // namespace
}  // namespace kvscope::quantized

using namespace kvscope::quantized;

// out = x @ W.T + bias with W a GGUF tensor's rows of blocks of ggml type `type`. out has
// x's dtype (or is fp32 for bf16 x: the bf16 result widened) and contiguous features; its
// rows may be strided (a merged projection's part writes its columns of the whole output).
void gguf_linear(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                 const std::optional<at::Tensor>& bias, at::Tensor out) {
  using kvscope::bf16;
  const char* op = "gguf_linear";
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x [rows, in] with contiguous features");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x float32 or bfloat16");
  const BlockFormat format = check_gguf_weight(weight, type, x.size(1), op);
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) &&
                  out.size(1) == weight.size(0) &&
                  (out.scalar_type() == x.scalar_type() || out.scalar_type() == at::kFloat),
              op, ": out [rows, out_features] of x's dtype (or float32), contiguous features");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == weight.size(0) &&
                        bias->scalar_type() == x.scalar_type()),
              op, ": bias [out_features] of x's dtype");
  if (x.scalar_type() == at::kFloat)
    gguf_linear_impl<float, float>(x, weight, type, format, bias_data<float>(bias), out);
  else if (out.scalar_type() == at::kFloat)
    gguf_linear_impl<bf16, float>(x, weight, type, format, bias_data<bf16>(bias), out);
  else
    gguf_linear_impl<bf16, bf16>(x, weight, type, format, bias_data<bf16>(bias), out);
}

// out [out_features, in] (fp32 or bf16) = the de-quantized weight, for a GEMM of many rows
// or an embedding's looked-up rows.
void gguf_dequantize(const at::Tensor& weight, int64_t type, at::Tensor out) {
  const char* op = "gguf_dequantize";
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == weight.size(0), op,
              ": out [out_features, in]");
  const int64_t in = out.size(1);
  const BlockFormat format = check_gguf_weight(weight, type, in, op);
  const uint8_t* blocks = weight.data_ptr<uint8_t>();
  with_out_dtype(out, op, [&](auto* y) {
    kvscope::parallel_for(0, weight.size(0), grain(weight.size(1)),
                          [&](int64_t begin, int64_t end) {
      std::vector<float> w(in);
      for (int64_t n = begin; n < end; ++n) {
        dequantize_row(type, format, blocks + n * weight.size(1), in, w.data());
        int64_t k = 0;
        for (; k + 16 <= in; k += 16) FP32Vec16::load(w.data() + k).store(y + n * in + k);
        for (; k < in; ++k) kvscope::store(y[n * in + k], w[k]);
      }
    });
  });
}

// The type code gguf_linear streams `type`'s rows faster as, once repacked at load
// (GgufLinear.repack), or -1 where it streams the file's blocks best: the lanes (common.h)
// of every type where the int4 kernels' VNNI dots run.
int64_t gguf_repacked_type(int64_t type) {
#if defined(KVSCOPE_VNNI_DOTS)
  if (lanes_of(kLanesCode + type) >= 0) return kLanesCode + type;
#endif
  (void)type;
  return -1;
}

// Whether gguf_linear rounds bf16 activations to int8 for integer dots on this build (per
// 256 values for Q4_K..Q6_K, per 32 for the rest); otherwise it computes exactly.
bool gguf_rounds_activations_to_int8() {
#if defined(KVSCOPE_GGUF_INT8_DOTS)
  return true;
#else
  return false;
#endif
}
