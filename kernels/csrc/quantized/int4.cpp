// int4_linear and int4_dequantize (the formats: quantized/common.h).
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

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

// The exact path (portable.h), kMaxRows rows of x at a time.
template <typename T>
void int4_linear_portable(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                          const at::Tensor& offsets, int64_t group_size, int group_shift,
                          const T* bias, at::Tensor& out) {
  const int64_t in = x.size(1), out_features = weight.size(0), groups = in / group_size;
  for (int64_t first = 0; first < x.size(0); first += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, x.size(0) - first));
    const T* x_rows = elements<T>(x) + first * x.stride(0);
    T* y = elements<T>(out) + first * out.stride(0);
    // x's group sums (for the offsets), zeros past `groups` in each row (read as vectors).
    std::vector<float> xsum(rows * padded_groups(groups), 0.f);
    const std::vector<float> xf = widen_rows(x_rows, x.stride(0), rows, in);
    for (int m = 0; m < rows; ++m)
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k)
          xsum[m * padded_groups(groups) + g] += xf[m * in + k];
    with_rows<kMaxRows>(rows, [&](auto rows_constant) {
      constexpr int M = decltype(rows_constant)::value;
      kvscope::parallel_for(0, out_features, grain(in / 2), [&](int64_t begin, int64_t end) {
        int4_rows<M, T>(xf.data(), xsum.data(), in, weight.data_ptr<uint8_t>(),
                        scales.data_ptr<at::Half>(), offsets.data_ptr<at::Half>(), group_shift,
                        bias, y, out.stride(0), begin, end);
      });
    });
  }
}

template <typename T>
void int4_linear_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                      const at::Tensor& offsets, int64_t group_size, const T* bias,
                      at::Tensor& out) {
  const int group_shift = __builtin_ctzll(group_size / kChunk);
#if defined(KVSCOPE_VNNI_DOTS)
  if constexpr (std::is_same_v<T, bf16>) {
    const Int4Layout layout(x.size(1), group_shift, x.size(1) / 2);
    return int4_linear_vnni<4>(x, weight.data_ptr<uint8_t>(), weight.size(0), layout,
                               HalfScales{scales.data_ptr<at::Half>(), offsets.data_ptr<at::Half>(),
                                          layout.groups, layout},
                               bias, out);
  }
#endif
  int4_linear_portable<T>(x, weight, scales, offsets, group_size, group_shift, bias, out);
}

void check_int4_weight(const at::Tensor& weight, const at::Tensor& scales,
                       const at::Tensor& offsets, int64_t group_size, int64_t in, const char* op) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.size(1) * 2 == in,
              op, ": weight uint8 [out_features, in / 2]");
  TORCH_CHECK(group_size >= kChunk && (group_size & (group_size - 1)) == 0 && in % group_size == 0,
              op, ": group_size a power of two >= 32 that divides in");
  for (const at::Tensor* part : {&scales, &offsets})
    TORCH_CHECK(part->scalar_type() == at::kHalf && part->is_contiguous() && part->dim() == 2 &&
                    part->size(0) == weight.size(0) && part->size(1) == in / group_size,
                op, ": scales and offsets float16 [out_features, in / group_size]");
}

}  // namespace
}  // namespace kvscope::quantized

using namespace kvscope::quantized;

// out = x @ W.T + bias with W the de-quantized int4 weight.
void int4_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                 const at::Tensor& offsets, int64_t group_size,
                 const std::optional<at::Tensor>& bias, at::Tensor out) {
  check_rows(x, weight, weight.size(1) * 2, bias, out, "int4_linear");
  check_int4_weight(weight, scales, offsets, group_size, x.size(1), "int4_linear");
  if (x.scalar_type() == at::kFloat)
    int4_linear_impl<float>(x, weight, scales, offsets, group_size, bias_data<float>(bias), out);
  else
    int4_linear_impl<kvscope::bf16>(x, weight, scales, offsets, group_size,
                                    bias_data<kvscope::bf16>(bias), out);
}

// out [out_features, in] = the de-quantized int4 weight, for the GEMM of many rows.
void int4_dequantize(const at::Tensor& weight, const at::Tensor& scales, const at::Tensor& offsets,
                     int64_t group_size, at::Tensor out) {
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
