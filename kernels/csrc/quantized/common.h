// What the int4 and int8 linears share: the weight formats, how output rows are split into
// blocks and chunks of work, and the argument checks.
//
// The linears run over weight-only quantized weights (engine/worker/models/quantized.py) for
// a few rows of activations: a single stream's decode reads every weight once per token, so
// the kernels stream the packed bytes once, de-quantize them in registers and dot them with
// every row of x while they are there. Many rows are compute-bound instead: those
// de-quantize the weight (int4_dequantize, int8_dequantize) and run a GEMM.
//
// int4: GGUF's Q4 chunks, byte j of each 16-byte chunk holding weight j (low nibble) and
// weight j + 16 (high nibble) of 32 consecutive inputs; weight = q * scale + offset with an
// fp16 scale and offset per group of inputs (Q4_0 / Q4_1 blocks copy in exactly). Each row's
// chunks are repacked (engine/worker/models/quantized.py, once at load time) in "wide blocks"
// of 16 chunks, [t 0..3][chunk 0..15][4 bytes] (bytes 4t..4t+3 of every chunk in one 64-byte
// load, chunk j in int32 lane j of a vpdpbusd); the chunks after the last whole block stay
// in GGUF's order.
// int8: one int8 per weight in x's order, weight = q * scale with one fp32 scale per output
// row.
//
// Two paths compute them: portable.h (weights widened to fp32, exact, any CPU) and vnni.h
// (bf16 activations rounded to int8 and dotted with vpdpbusd, on CPUs with AVX512-VNNI).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "vec.hpp"
#include "work_pool.h"

namespace kvscope::quantized {

using vec::FP32Vec16;

constexpr int kMaxRows = 8;          // rows of x dotted with each weight while it is loaded
constexpr int64_t kChunk = 32;       // int4 weights in one 16-byte chunk
constexpr int64_t kWideChunks = 16;  // int4 chunks in one wide block
// Outputs are computed for blocks of 16 consecutive output rows: the block's scales and
// offsets widen in whole vectors, and its outputs (+ bias) are stored as vectors too.
constexpr int64_t kRowBlock = 16;
// Fewest weight bytes one chunk of work streams: every layer of a small model splits across
// the threads, as the dense one-row kernel's (64 rows of bf16 weights, ~72 KB for a 576-wide
// layer) do. kvscope::parallel_for lets the caller take every chunk no helper has started,
// so a descheduled helper does not stall a layer.
constexpr int64_t kBytesPerTask = 64 << 10;

inline int64_t grain(int64_t row_bytes) { return std::max<int64_t>(1, kBytesPerTask / row_bytes); }

// The fewest output rows of an int4 layer per chunk of work. A single stream's layer goes
// one share per thread: its weights stream with a software prefetch kvscope::kPrefetchBytes ahead
// within a chunk (int4_rows_vnni), so each chunk starts its stream cold, and more, smaller
// chunks per thread would start more cold streams. A helper that has not started still
// leaves its share to the caller.
inline int64_t int4_chunk_rows(int64_t rows, int64_t out_features, int64_t row_bytes) {
  if (rows > kMaxRows) return grain(row_bytes);
  return std::max(grain(row_bytes), kvscope::one_share_per_thread(out_features));
}

inline int64_t padded_groups(int64_t groups) { return (groups + 15) / 16 * 16; }

// One 16-byte int4 chunk: weights 0..15 in the low nibbles, 16..31 in the high ones.
struct Int4Chunk {
  vec::U8Vec16 packed;

  static Int4Chunk load(const uint8_t* p) { return {vec::U8Vec16::load(p)}; }
  FP32Vec16 low() const { return FP32Vec16::widen(packed & 15); }
  FP32Vec16 high() const { return FP32Vec16::widen(packed >> 4); }
};

// Rows of x widened to fp32 once per call, [rows, in].
template <typename T>
std::vector<float> widen_rows(const T* x, int64_t x_stride, int64_t rows, int64_t in) {
  std::vector<float> xf(rows * in);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t k = 0; k < in; ++k) xf[m * in + k] = load(x[m * x_stride + k]);
  return xf;
}

// Lanes: a GGUF type's rows repacked at load (kvscope's own layouts, kernels/gguf_lanes.py) for the
// int4 kernels' dots (vnni.h), the file's values bit for bit. A row starts with its quants in
// 32-weight chunks: 4 bits as Int4Linear's nibbles; 5 bits as those nibbles, then per 64-byte load
// of them (a tail quad's shorter one too) 16 bytes of 5th bits (two 64-bit masks: bit i of the
// first is the 5th bit of the weight in the load's byte i's low nibble, of the second its high
// one's); 6 bits (Q6_K) as the nibbles, then per two 64-byte loads of them 64 bytes of top bit
// pairs (load 2u's in the low nibbles, 2u + 1's in the high ones; in each, bits 0-1 for the
// weight in that byte's low nibble, 2-3 for its high one's); 8 bits (Q8_0's q + 128) as
// vnni.h's int4_dot_row lays them. Then:
//   Q4_0..Q8_0 a float16 scale d per chunk; Q4_1 and Q5_1 then their float16 m per chunk,
//     the others' offsets being -8 d (Q4_0), -16 d (Q5_0), -128 d (Q8_0), which the kernels
//     compute (exact products in fp32; kquants_blocks.h's block32_offset_per_d);
//   Q4_K, Q5_K (KLanesRow) per chunk (sub-block) its 6-bit scale sc and min m (a byte
//     each), then per 256-weight super-block its float16 d, then its dmin:
//     weight = (d * sc) * q - dmin * m;
//   Q6_K (Q6LanesRow) per 16 weights its int8 scale sc, then per super-block its float16 d:
//     weight = (d * sc) * (q - 32).
// A type's lanes have the code kLanesCode + its ggml type id (ggml's stay below 100).
constexpr int64_t kLanesCode = 100;
constexpr int64_t kSuperBlock = 256;
// Weight bytes one 512-bit dot reads: the step of the 8-bit lanes' layout, which the
// portable de-quantization (kquants.cpp's lanes_quants) walks on every CPU.
constexpr int64_t kStepBytes = 64;

// The quants' bytes of a row of `in` weights with `bits` bits each.
constexpr int64_t lanes_quant_bytes(int bits, int64_t in) {
  return bits == 8   ? in
         : bits == 6 ? in / 2 + in / 4
                     : in / 2 + (bits == 5 ? 16 * ((in / 2 + 63) / 64) : 0);
}

struct Q6LanesRow {
  const int8_t* sc;
  const at::Half* d;

  Q6LanesRow(const uint8_t* row, int64_t in)
      : sc(reinterpret_cast<const int8_t*>(row + lanes_quant_bytes(6, in))),
        d(reinterpret_cast<const at::Half*>(sc + in / 16)) {}
};

struct KLanesRow {
  const uint8_t *sc, *m;
  const at::Half *d, *dmin;

  KLanesRow(const uint8_t* row, int64_t in, bool five)
      : sc(row + lanes_quant_bytes(five ? 5 : 4, in)),
        m(sc + in / kChunk),
        d(reinterpret_cast<const at::Half*>(m + in / kChunk)),
        dmin(d + in / kSuperBlock) {}
};

// One int4 row in GGUF's chunk order again: the wide blocks un-transposed, the rest copied.
inline void gguf_order_row(const uint8_t* row, int64_t chunks, uint8_t* out) {
  const int64_t wide = chunks / kWideChunks;
  for (int64_t k = 0; k < wide; ++k)
    for (int64_t j = 0; j < kWideChunks; ++j)
      for (int64_t t = 0; t < 4; ++t)
        std::memcpy(out + (k * kWideChunks + j) * 16 + 4 * t,
                    row + k * kWideChunks * 16 + t * 64 + 4 * j, 4);
  std::memcpy(out + wide * kWideChunks * 16, row + wide * kWideChunks * 16,
              (chunks - wide * kWideChunks) * 16);
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
      const FP32Vec16 b = bias != nullptr ? FP32Vec16::load(bias + first) : FP32Vec16();
      (FP32Vec16::load(y[m]) + b).rounded_to(precision).store(row);
    } else {
      for (int64_t i = 0; i < count; ++i)
        store(row[i],
              round_to(y[m][i] + (bias != nullptr ? load(bias[first + i]) : 0.f), precision));
    }
  }
}

// widened_out: the op also writes bf16 x's result into an fp32 out.
inline void check_rows(const at::Tensor& x, const at::Tensor& weight, int64_t in,
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
              op, ": out [rows, out_features] of x's dtype", widened_out ? " (or float32)" : "");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == weight.size(0) &&
                        bias->scalar_type() == x.scalar_type()),
              op, ": bias [out_features]");
}

inline void check_dense_out(const at::Tensor& weight, int64_t in, const at::Tensor& out,
                            const char* op) {
  TORCH_CHECK(
      out.is_contiguous() && out.dim() == 2 && out.size(0) == weight.size(0) && out.size(1) == in,
      op, ": out [out_features, in]");
}

template <typename T>
const T* bias_data(const std::optional<at::Tensor>& bias) {
  return bias ? elements<T>(*bias) : nullptr;
}

// Calls body(T* out) with out's data as float or bf16 bits.
template <typename Body>
void with_out_dtype(at::Tensor& out, const char* op, Body&& body) {
  if (out.scalar_type() == at::kFloat) return body(out.data_ptr<float>());
  TORCH_CHECK(out.scalar_type() == at::kBFloat16, op, ": out float32 or bfloat16");
  body(elements<bf16>(out));
}

}  // namespace kvscope::quantized
