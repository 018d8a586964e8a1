// The exact path of the int4 and int8 linears, for any CPU: the weights widened to fp32 and
// dotted with x widened to fp32 (FP32Vec16). fp32 activations take it everywhere, bf16 ones
// on CPUs without AVX512-VNNI (vnni.h). Also the de-quantization for the GEMM of many rows.
// A row's 16 accumulator lanes are summed as 8 (add_halves, then FP32Vec8's tree): the
// cheap order on AVX2, where a FP32Vec16 is two registers, and the same order on every CPU.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "quantized/common.h"

namespace kvscope::quantized {

// float16 values widened to fp32, 16 at a time, the last few one by one.
inline void widen_halves(const at::Half* p, int64_t count, float* out) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) FP32Vec16::load(p + i).store(out + i);
  for (; i < count; ++i) out[i] = static_cast<float>(p[i]);
}

// body(first, count, scale, offset) for each block of up to kRowBlock int4 output rows in
// [begin, end), with the block's scales and offsets widened to fp32, [row][group], and 16
// zeros after the last row: a row's offsets are read in whole vectors, whatever runs past
// `groups` meets zeros in x's group sums.
template <typename Body>
void int4_row_blocks(const at::Half* scales, const at::Half* offsets, int64_t groups, int64_t begin,
                     int64_t end, Body&& body) {
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
  int4_row_blocks(scales, offsets, groups, begin, end,
                  [&](int64_t first, int64_t count, const float* scale, const float* offset) {
    float y[M][kRowBlock];
    std::vector<uint8_t> ordered(in / 2);
    for (int64_t i = 0; i < count; ++i) {
      gguf_order_row(weight + (first + i) * in / 2, chunks, ordered.data());
      const uint8_t* row = ordered.data();
      const float* row_scale = scale + i * groups;
      // Even and odd chunks add into separate accumulators: two dependent chains, not one.
      FP32Vec16 even[M], odd[M];
      auto add_chunk = [&](int64_t c, FP32Vec16* acc) {
        const FP32Vec16 s(row_scale[c >> group_shift]);
        const Int4Chunk chunk = Int4Chunk::load(row + c * kChunk / 2);
        const FP32Vec16 low = chunk.low(), high = chunk.high();
        for (int m = 0; m < M; ++m) {
          const float* xm = xf + m * in + c * kChunk;
          const FP32Vec16 dot = vec::fma(low, FP32Vec16::load(xm), high * FP32Vec16::load(xm + 16));
          acc[m] = vec::fma(dot, s, acc[m]);
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
        FP32Vec16 shift;
        for (int64_t g = 0; g < groups; g += 16)
          shift = vec::fma(FP32Vec16::load(row_offset + g),
                           FP32Vec16::load(xsum + m * padded_groups(groups) + g), shift);
        y[m][i] = (even[m] + odd[m] + shift).add_halves().reduce_sum();
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
      FP32Vec16 even[M], odd[M];
      auto add_chunk = [&](int64_t k, FP32Vec16* acc) {
        const FP32Vec16 a = FP32Vec16::widen(row + k);
        const FP32Vec16 b = FP32Vec16::widen(row + k + 16);
        for (int m = 0; m < M; ++m)
          acc[m] += vec::fma(a, FP32Vec16::load(xf + m * in + k),
                             b * FP32Vec16::load(xf + m * in + k + 16));
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
        float sum = (even[m] + odd[m]).add_halves().reduce_sum();
        for (int64_t tail = k; tail < in; ++tail) sum += row[tail] * xf[m * in + tail];
        y[m][i] = sum * scales[first + i];
      }
    }
    store_block<M>(out, out_stride, first, count, y, bias);
  }
}

// Rows [begin, end) of int4 weights, de-quantized (computed in fp32, rounded once to T).
template <typename T>
void int4_dequantize_rows(const uint8_t* weight, const at::Half* scales, const at::Half* offsets,
                          int64_t group_size, int64_t in, T* out, int64_t begin, int64_t end) {
  const int64_t groups = in / group_size;
  std::vector<uint8_t> ordered(in / 2);
  for (int64_t n = begin; n < end; ++n) {
    gguf_order_row(weight + n * in / 2, in / kChunk, ordered.data());
    for (int64_t g = 0; g < groups; ++g) {
      const FP32Vec16 s(static_cast<float>(scales[n * groups + g]));
      const FP32Vec16 o(static_cast<float>(offsets[n * groups + g]));
      for (int64_t k = g * group_size; k < (g + 1) * group_size; k += kChunk) {
        const Int4Chunk chunk = Int4Chunk::load(ordered.data() + k / 2);
        vec::fma(chunk.low(), s, o).store(out + n * in + k);
        vec::fma(chunk.high(), s, o).store(out + n * in + k + 16);
      }
    }
  }
}

// Rows [begin, end) of int8 weights, de-quantized.
template <typename T>
void int8_dequantize_rows(const int8_t* weight, const float* scales, int64_t in, T* out,
                          int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* row = weight + n * in;
    T* y = out + n * in;
    int64_t k = 0;
    for (; k + 16 <= in; k += 16) (FP32Vec16::widen(row + k) * scales[n]).store(y + k);
    for (; k < in; ++k) store(y[k], row[k] * scales[n]);
  }
}

}  // namespace kvscope::quantized
