// bf16 GEMMs on CPUs without bf16 dot products (no AVX512-BF16, no AMX): oneDNN's bf16 GEMM
// there widens every operand inside its inner loop and runs at a fraction of the same CPU's fp32
// GEMM (docs/performance-history.md, 'Batched bf16 GEMMs on a CPU without bf16 dot products').
// linear_widened widens the weight once per call instead, a tile of rows at a time into a buffer,
// and runs the fp32 GEMM on each tile: the weights stay bf16 in memory (half the bytes), the
// arithmetic is fp32, and the result is rounded to bf16 once, as oneDNN's bf16 GEMM rounds it.
//
// Its loops run on torch's OpenMP threads, as the fp32 GEMM between them does, not on the
// kernels' work pool (work_pool.h): a pool helper spinning for its next loop would hold a
// core the GEMM's second thread is waiting for.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "vec.hpp"

namespace {

using kvscope::bf16;
using kvscope::vec::FP32Vec16;

// About 8 MiB of widened weight per tile: a layer's weight is one tile, so one GEMM call
// (each call forks and joins its threads and packs its operands: 1 MiB tiles cost more at 64 rows,
// docs/performance-history.md, 'Batched bf16 GEMMs on a CPU without bf16 dot products'), and only a
// large vocabulary's output projection is split, so the buffer stays bounded. Whole multiples of 64
// rows keep the GEMM's column blocks full.
int64_t tile_rows(int64_t in_features) {
  constexpr int64_t kTileBytes = 8 << 20;
  return std::clamp<int64_t>(kTileBytes / (4 * in_features) / 64 * 64, 64, 16384);
}

// rows [first, first + count) of the bf16 matrix `source` (row stride `stride`) as fp32
// rows of `columns` values in `target` (exact: bf16 bits shifted into fp32's high half).
void widen_rows(const bf16* source, int64_t stride, int64_t first, int64_t count, int64_t columns,
                float* target) {
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const bf16* from = source + (first + row) * stride;
      float* to = target + row * columns;
      int64_t k = 0;
      for (; k + 16 <= columns; k += 16) FP32Vec16::load(from + k).store(to + k);
      for (; k < columns; ++k) to[k] = kvscope::load(from[k]);
    }
  });
}

// out[:, first:first + count] = round_bf16(product + bias[first:first + count]); an fp32 out
// holds the bf16-rounded value widened (the logits, as `.float()` of a bf16 result).
template <typename Out>
void write_columns(const at::Tensor& product, const bf16* bias, int64_t first, Out* out,
                   int64_t out_stride) {
  const int64_t rows = product.size(0), count = product.size(1);
  const float* values = product.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* from = values + row * count;
      Out* to = out + row * out_stride + first;
      for (int64_t j = 0; j < count; ++j) {
        const float sum = bias ? from[j] + kvscope::load(bias[first + j]) : from[j];
        kvscope::store(to[j], kvscope::round_to(sum, static_cast<bf16*>(nullptr)));
      }
    }
  });
}

}  // namespace

bool widens_bf16_gemms() {
#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
  return false;
#else
  return true;
#endif
}

void linear_widened(const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.dim() == 2 && weight.stride(1) == 1 &&
                  out.is_contiguous() && x.size(1) == weight.size(1) && out.size(0) == x.size(0) &&
                  out.size(1) == weight.size(0),
              "linear_widened: x [rows, in], weight [out, in], out [rows, out]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat) &&
                  (!bias || (bias->is_contiguous() && bias->scalar_type() == at::kBFloat16)),
              "linear_widened: bf16 x, weight and bias; out bf16 or fp32");
  const int64_t rows = x.size(0), in = x.size(1), outs = weight.size(0);
  const auto fp32 = x.options().dtype(at::kFloat);
  at::Tensor wide_x = at::empty({rows, in}, fp32);
  widen_rows(kvscope::elements<bf16>(x), x.stride(0), 0, rows, in, wide_x.data_ptr<float>());
  const int64_t tile = std::min(tile_rows(in), outs);
  at::Tensor wide_weight = at::empty({tile, in}, fp32);
  at::Tensor product = at::empty({rows, tile}, fp32);
  const bf16* bias_values = bias ? kvscope::elements<bf16>(*bias) : nullptr;
  for (int64_t first = 0; first < outs; first += tile) {
    const int64_t count = std::min(tile, outs - first);
    widen_rows(kvscope::elements<bf16>(weight), weight.stride(0), first, count, in,
               wide_weight.data_ptr<float>());
    if (count < tile) product = at::empty({rows, count}, fp32);
    at::mm_out(product, wide_x, wide_weight.narrow(0, 0, count).t());
    if (out.scalar_type() == at::kFloat)
      write_columns(product, bias_values, first, out.data_ptr<float>(), out.stride(0));
    else
      write_columns(product, bias_values, first, kvscope::elements<bf16>(out), out.stride(0));
  }
}
