// int8_linear and int8_dequantize (the format: quantized/common.h).
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "quantized/common.h"
#include "quantized/portable.h"
#include "quantized/vnni.h"
#include "work_pool.h"

namespace kvscope::quantized {
namespace {

#if defined(KVSCOPE_VNNI_DOTS)
// bf16 x rounded to int8 (vnni.h), all rows against the weights tile by tile.
template <typename Out>
void int8_linear_vnni(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                      const bf16* bias, at::Tensor& out) {
  const int64_t in = x.size(1), out_features = weight.size(0);
  const int rows = static_cast<int>(x.size(0));
  const Int8Rows xq = quantize_rows(elements<bf16>(x), x.stride(0), rows, in);
  const Int8Lanes xl = int8_lanes(xq, rows);
  all_rows_by_tiles(rows, xl.row_bytes, out_features, grain(in),
                    [&](auto rows_constant, int x_first, int64_t begin, int64_t end) {
    constexpr int M = decltype(rows_constant)::value;
    int8_rows_vnni<M>(xl, x_first, xq.scaled_q_sums.data() + x_first, in, weight.data_ptr<int8_t>(),
                      scales.data_ptr<float>(), bias, elements<Out>(out) + x_first * out.stride(0),
                      out.stride(0), begin, end);
  });
}
#endif

// The exact path (portable.h), kMaxRows rows of x at a time.
template <typename T, typename Out>
void int8_linear_portable(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                          const T* bias, at::Tensor& out) {
  const int64_t in = x.size(1), out_features = weight.size(0);
  for (int64_t first = 0; first < x.size(0); first += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, x.size(0) - first));
    const T* x_rows = elements<T>(x) + first * x.stride(0);
    Out* y = elements<Out>(out) + first * out.stride(0);
    const std::vector<float> xf = widen_rows(x_rows, x.stride(0), rows, in);
    with_rows<kMaxRows>(rows, [&](auto rows_constant) {
      constexpr int M = decltype(rows_constant)::value;
      kvscope::parallel_for(0, out_features, grain(in), [&](int64_t begin, int64_t end) {
        int8_rows<M, T>(xf.data(), in, weight.data_ptr<int8_t>(), scales.data_ptr<float>(), bias, y,
                        out.stride(0), begin, end);
      });
    });
  }
}

// Out: T, or fp32 for bf16 T (see store_block).
template <typename T, typename Out>
void int8_linear_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                      const T* bias, at::Tensor& out) {
#if defined(KVSCOPE_VNNI_DOTS)
  if constexpr (std::is_same_v<T, bf16>) return int8_linear_vnni<Out>(x, weight, scales, bias, out);
#endif
  int8_linear_portable<T, Out>(x, weight, scales, bias, out);
}

void check_int8_weight(const at::Tensor& weight, const at::Tensor& scales, const char* op) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(), op,
              ": weight int8 [out_features, in]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == weight.size(0),
              op, ": scales float32 [out_features]");
}

}  // namespace
}  // namespace kvscope::quantized

using namespace kvscope::quantized;

// out = x @ (q * scale).T + bias with int8 q [out_features, in] and fp32 scale per row. out
// has x's dtype, or is fp32 for bf16 x (logits): the bf16 result widened, written directly.
void int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                 const std::optional<at::Tensor>& bias, at::Tensor out) {
  using kvscope::bf16;
  check_rows(x, weight, weight.size(1), bias, out, "int8_linear", /*widened_out=*/true);
  check_int8_weight(weight, scales, "int8_linear");
  if (x.scalar_type() == at::kFloat)
    int8_linear_impl<float, float>(x, weight, scales, bias_data<float>(bias), out);
  else if (out.scalar_type() == at::kFloat)
    int8_linear_impl<bf16, float>(x, weight, scales, bias_data<bf16>(bias), out);
  else
    int8_linear_impl<bf16, bf16>(x, weight, scales, bias_data<bf16>(bias), out);
}

// out [out_features, in] = the de-quantized int8 weight, for the GEMM of many rows.
void int8_dequantize(const at::Tensor& weight, const at::Tensor& scales, at::Tensor out) {
  check_int8_weight(weight, scales, "int8_dequantize");
  const int64_t in = weight.size(1);
  check_dense_out(weight, in, out, "int8_dequantize");
  with_out_dtype(out, "int8_dequantize", [&](auto* y) {
    kvscope::parallel_for(0, weight.size(0), grain(in), [&](int64_t begin, int64_t end) {
      int8_dequantize_rows(weight.data_ptr<int8_t>(), scales.data_ptr<float>(), in, y, begin, end);
    });
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
