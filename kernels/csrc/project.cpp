// The projections every C++ caller runs (project.h): the same rules, row count by row count,
// as the Python modules' linears (kernels/cpu_kernels.py's linear, the packed modules of
// engine/worker/models/quantized.py).
#include "project.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>

#include <optional>

#include "cpu_ops.h"

namespace {

using kvscope::LinearWeights;
using kvscope::ProjectLimits;
using kvscope::traced;

constexpr int64_t kWidenedMinRows = 48;  // kernels/cpu_kernels.py's WIDENED_MIN_ROWS

// out = x @ weight.T (+ bias) through oneDNN's GEMM, in x's dtype; an fp32 out of bf16 x (the
// logits) holds that result widened, as `.float()` of it from Python would. bf16 on a CPU
// without bf16 dot products, from kWidenedMinRows rows: fp32 GEMMs over widened weight tiles
// (kernels/cpu_kernels.py's linear takes the same route).
void gemm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
          at::Tensor& out) {
  static const bool widen = widens_bf16_gemms();
  const bool bf16 = x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                    (!bias || bias->scalar_type() == at::kBFloat16);
  const bool plain = x.stride(1) == 1 && weight.stride(1) == 1 && out.is_contiguous() &&
                     (!bias || bias->is_contiguous());
  if (widen && x.size(0) >= kWidenedMinRows && bf16 && plain)
    traced("kvscope::linear_widened", [&] { linear_widened(x, weight, bias, out); });
  else if (out.scalar_type() == x.scalar_type())
    at::linear_out(out, x, weight, bias);
  else
    out.copy_(at::linear(x, weight, bias));
}

// Dense weights: up to this many rows stream their weights through the dot-product kernel;
// weights oneDNN prepacked (its AMX tiles) through the blocked kernel's AMX path up to the
// second, and kvscope's own tiles through the blocked kernel at any row count.
// kernels/cpu_kernels.py's DENSE_KERNEL_MAX_ROWS and AMX_TILE_KERNEL_MAX_ROWS, the same rule.
constexpr int64_t kDenseKernelMaxRows = 32;
constexpr int64_t kAmxTileKernelMaxRows = 64;

// out = x @ weight.T (+ bias) for a plain dense weight, as kernels/cpu_kernels.py's linear
// computes it: a few rows stream the weight through the dot-product kernel, more go to gemm().
void dense_project(const at::Tensor& x, const at::Tensor& weight,
                   const std::optional<at::Tensor>& bias, at::Tensor& out) {
  if (x.size(0) > kDenseKernelMaxRows) return gemm(x, weight, bias, out);
  traced("kvscope::linear_small_batch", [&] { linear_small_batch(x, weight, bias, out); });
}

// out = x @ weight.T (+ bias) for MXFP4 weights (uint8 blocks and uint8 e8m0 scales: gpt-oss's
// experts), streamed up to kernel_max_rows rows, else de-quantized once for the dense route.
void mxfp4_project(const at::Tensor& x, const LinearWeights& linear, const ProjectLimits& limits,
                   at::Tensor& out) {
  if (x.size(0) <= limits.kernel_max_rows)
    return traced("kvscope::mxfp4_linear",
                  [&] { mxfp4_linear(x, linear.weight, *linear.scales, linear.bias, out); });
  at::Tensor dense = at::empty({linear.weight.size(0), x.size(1)}, x.options());
  traced("kvscope::mxfp4_dequantize",
         [&] { mxfp4_dequantize(linear.weight, *linear.scales, dense); });
  dense_project(x, dense, linear.bias, out);
}

// out = x @ weight.T (+ bias) for packed weights: up to kernel_max_rows rows stream the packed
// weight through a kernel; more rows are compute-bound and de-quantize it once for the dense
// route (the packed modules' forward does the same through cpu_kernels.linear).
void quantized_project(const at::Tensor& x, const LinearWeights& linear, const ProjectLimits& limits,
                       at::Tensor& out) {
  if (linear.scales->scalar_type() == at::kByte) return mxfp4_project(x, linear, limits, out);
  const bool int4 = linear.weight.scalar_type() == at::kByte;
  if (x.size(0) <= limits.kernel_max_rows) {
    if (int4)
      traced("kvscope::int4_linear", [&] {
        int4_linear(x, linear.weight, *linear.scales, *linear.offsets, limits.group_size,
                    linear.bias, out);
      });
    else
      traced("kvscope::int8_linear",
             [&] { int8_linear(x, linear.weight, *linear.scales, linear.bias, out); });
    return;
  }
  at::Tensor dense = at::empty({linear.weight.size(0), x.size(1)}, x.options());
  if (int4)
    traced("kvscope::int4_dequantize", [&] {
      int4_dequantize(linear.weight, *linear.scales, *linear.offsets, limits.group_size, dense);
    });
  else
    traced("kvscope::int8_dequantize",
           [&] { int8_dequantize(linear.weight, *linear.scales, dense); });
  dense_project(x, dense, linear.bias, out);
}

// out = x @ weight.T (+ bias) for a GGUF layer, run by run of rows as GgufLinear computes it:
// up to kernel_max_rows rows stream into each run's columns of out; more de-quantize every
// run into one dense weight for the dense route.
void gguf_project(const at::Tensor& x, const LinearWeights& linear, const ProjectLimits& limits,
                  at::Tensor& out) {
  const at::Tensor& parts = *linear.gguf_parts;
  const int64_t runs = parts.size(0);
  const int64_t* part = parts.data_ptr<int64_t>();
  // A layer the file stores dense throughout (an F16 / BF16 file) is a plain dense weight.
  if (runs == 1 && part[0] < 0) return dense_project(x, linear.gguf_weights[0], linear.bias, out);
  if (x.size(0) > limits.kernel_max_rows) {
    at::Tensor dense = at::empty({linear.out_features(), x.size(1)}, x.options());
    for (int64_t r = 0; r < runs; ++r) {
      at::Tensor rows = dense.narrow(0, part[3 * r + 1], part[3 * r + 2] - part[3 * r + 1]);
      if (part[3 * r] < 0)
        rows.copy_(linear.gguf_weights[r]);
      else
        traced("kvscope::gguf_dequantize",
               [&] { gguf_dequantize(linear.gguf_weights[r], part[3 * r], rows); });
    }
    // An fp32 out (the logits) gets the result in x's dtype widened, as GgufLinear's `.to`
    // gives it: both routes of dense_project write it so.
    return dense_project(x, dense, linear.bias, out);
  }
  for (int64_t r = 0; r < runs; ++r) {
    const int64_t first = part[3 * r + 1], count = part[3 * r + 2] - first;
    // One run is the whole layer: out and bias as they are (a view costs a dispatcher call:
    // docs/performance-history.md, "The decoder stack's views").
    std::optional<at::Tensor> bias = linear.bias;
    at::Tensor columns = out;
    if (runs > 1) {
      if (bias) bias = bias->narrow(0, first, count);
      columns = out.narrow(1, first, count);
    }
    if (part[3 * r] < 0) {
      // The dense kernel writes whole rows; these columns are a strided slice of them.
      at::Tensor dense = at::empty({x.size(0), count}, out.options());
      dense_project(x, linear.gguf_weights[r], bias, dense);
      columns.copy_(dense);
    } else
      traced("kvscope::gguf_linear",
             [&] { gguf_linear(x, linear.gguf_weights[r], part[3 * r], bias, columns); });
  }
}

}  // namespace

// out = x @ weight.T (+ bias), in x's dtype or (the logits) fp32, as kernels/cpu_kernels.py's
// linear computes it. Dense weights: a few rows stream their weights through the
// dot-product kernel, more rows go to oneDNN's GEMM; tiled ones through the blocked kernel,
// but past kAmxTileKernelMaxRows rows over oneDNN's tiles, which go to its GEMM; packed ones
// as their modules do.
void kvscope::project(const at::Tensor& x, const LinearWeights& linear,
                      const ProjectLimits& limits, at::Tensor& out) {
  if (linear.gguf_parts) return gguf_project(x, linear, limits, out);
  if (linear.scales) return quantized_project(x, linear, limits, out);
  if (linear.onednn && x.size(0) > kAmxTileKernelMaxRows) {
    // oneDNN's op writes a tensor of its own: that tensor becomes `out` (a copy into the
    // workspace cost a tenth of the GEMM), unless the logits need it widened.
    at::Tensor result = linear_onednn(x, *linear.onednn, linear.bias);
    if (result.scalar_type() == out.scalar_type())
      out = std::move(result);
    else
      out.copy_(result);
    return;
  }
  if (linear.tile)
    return traced("kvscope::linear_blocked",
                  [&] { linear_blocked(x, linear.weight, linear.bias, out); });
  dense_project(x, linear.weight, linear.bias, out);
}

