// A quantized KV cache (kernels/kv_quant.py: fp8 or int8 codes, a bf16 scale per row): its
// dtypes, its rows' codes as bf16 for the pair-dot paths, and the quantizing store. The
// attention paths read its rows in place like any cache's: codes widen to fp32 in registers, a
// key row's scale multiplies its widened row and a value row's its softmax weight (row_scale).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention/common.h"
#include "cpu_common.h"
#include "vec.hpp"

namespace kvscope::attention {

// Whether a cache of this dtype holds codes and scales.
inline bool quantized_kv(at::ScalarType type) {
  return type == at::ScalarType::Float8_e4m3fn || type == at::ScalarType::Float8_e5m2 ||
         type == at::kChar;
}

// fn(Q{}, KV{}) for a float or bf16 tensor and a quantized cache's code type.
template <typename Fn>
void with_quantized(at::ScalarType values, at::ScalarType codes, Fn fn) {
  auto with_codes = [&](auto value) {
    if (codes == at::ScalarType::Float8_e4m3fn)
      fn(value, kvscope::fp8_e4m3{});
    else if (codes == at::ScalarType::Float8_e5m2)
      fn(value, kvscope::fp8_e5m2{});
    else
      fn(value, int8_t{});
  };
  if (values == at::kFloat)
    with_codes(float{});
  else
    with_codes(kvscope::bf16{});
}

#if defined(__AVX512BF16__)
// A chunk's quantized K or V rows as bf16 rows in `out` (exact), and their scales.
template <int kDim, typename KV>
inline void codes_to_bf16(const KV* const* rows, int n, kvscope::bf16* out,
                          const kvscope::bf16** out_rows, float* scales) {
  for (int i = 0; i < n; ++i) {
    kvscope::bf16* row = out + static_cast<int64_t>(i) * kDim;
#pragma GCC unroll 8
    for (int d = 0; d < kDim; d += 16)
      kvscope::vec::FP32Vec16::load(rows[i] + d).store_exact(row + d);
    out_rows[i] = row;
    scales[i] = row_scale(rows[i], kDim);
  }
}
#endif

// Quantizes each row of `rows` values [heads, dim] (a token's K or V) into its cache slot:
// codes value / scale with scale = max |value| / kCodeMax rounded to bf16, exactly as
// kernels/kv_quant.quantize does.
template <typename T, typename Code>
void quantize_rows(const at::Tensor& rows, at::Tensor& cache, const int64_t* slots) {
  const int64_t tokens = rows.size(0), heads = rows.size(1), dim = rows.size(2);
  const int64_t block_size = cache.size(1);
  const T* values = kvscope::elements<T>(rows);
  Code* codes = kvscope::elements<Code>(cache);
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    const int64_t base =
        (slots[t] / block_size) * cache.stride(0) + (slots[t] % block_size) * cache.stride(1);
    for (int64_t h = 0; h < heads; ++h) {
      const T* row = values + t * rows.stride(0) + h * rows.stride(1);
      Code* target = codes + base + h * cache.stride(2);
      float amax = 0.f;
      for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(load(row[d])));
      const kvscope::bf16 scale_bits =
          kvscope::bf16_bits(amax > 0.f ? amax / kvscope::kCodeMax<Code> : 1.f);
      const float scale = load(scale_bits);
      for (int64_t d = 0; d < dim; ++d)
        store(target[d],
              std::clamp(load(row[d]) / scale, -kvscope::kCodeMax<Code>, kvscope::kCodeMax<Code>));
      std::memcpy(target + dim, &scale_bits, sizeof(scale_bits));
    }
  }
}

}  // namespace kvscope::attention
