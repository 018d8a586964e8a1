// Fused CPU ops for the Llama-family forward: each replaces several small eager ops (whose
// dispatch costs more than their math at decode batch sizes) with one pass over the data.
// Every op computes in fp32 and rounds to the tensor's dtype where the eager code rounds.
#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "work_pool.h"

namespace {

using kvscope::load;
using kvscope::round_to;
using kvscope::store;

template <typename T>
void rms_norm_rows(T* hidden, int64_t hidden_stride, T* residual, int64_t residual_stride,
                   const T* weight, T* out, int64_t out_stride, int64_t rows, int64_t width,
                   float eps) {
  kvscope::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(width);
    for (int64_t r = begin; r < end; ++r) {
      const T* x = hidden + r * hidden_stride;
      // The sums of squares vectorized (in lanes, then added up): summed in order, one
      // dependent add per element would bound a norm by the add's latency.
      float sum = 0.f;
      if (residual != nullptr) {
        // residual <- residual + hidden, rounded as the eager `residual + hidden` is
        T* res = residual + r * residual_stride;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < width; ++i) {
          const float value = round_to(load(res[i]) + load(x[i]), static_cast<T*>(nullptr));
          store(res[i], value);
          row[i] = value;
          sum += value * value;
        }
      } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < width; ++i) {
          row[i] = load(x[i]);
          sum += row[i] * row[i];
        }
      }
      const float inverse = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
      T* y = out + r * out_stride;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i)
        store(y[i], load(weight[i]) * round_to(row[i] * inverse, static_cast<T*>(nullptr)));
    }
  });
}

}  // namespace

// out = weight * rms_norm(hidden); with a residual, first residual += hidden and normalise
// the sum (the residual stream then holds it for the next layer).
void rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps, at::Tensor out,
              std::optional<at::Tensor> residual) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.stride(1) == 1 && out.stride(1) == 1,
              "rms_norm: rows [tokens, hidden] with contiguous features");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == hidden.scalar_type() &&
                  out.scalar_type() == hidden.scalar_type(),
              "rms_norm: one dtype for all");
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  if (residual)
    TORCH_CHECK(residual->stride(1) == 1 && residual->scalar_type() == hidden.scalar_type(),
                "rms_norm: residual layout");
  if (hidden.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(kvscope::elements<float>(hidden), hidden.stride(0),
                         residual ? kvscope::elements<float>(*residual) : nullptr,
                         residual ? residual->stride(0) : 0, kvscope::elements<float>(weight),
                         kvscope::elements<float>(out), out.stride(0), rows, width,
                         static_cast<float>(eps));
  } else {
    TORCH_CHECK(hidden.scalar_type() == at::kBFloat16, "rms_norm: float32 or bfloat16");
    using B = kvscope::bf16;
    rms_norm_rows<B>(kvscope::elements<B>(hidden), hidden.stride(0),
                     residual ? kvscope::elements<B>(*residual) : nullptr,
                     residual ? residual->stride(0) : 0, kvscope::elements<B>(weight),
                     kvscope::elements<B>(out), out.stride(0), rows, width,
                     static_cast<float>(eps));
  }
}

namespace {

template <typename T>
void rotate_rows(T* qkv, int64_t row_stride, const float* cos, const float* sin, int64_t tokens,
                 int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  kvscope::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * dim;
      const float* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qkv + t * row_stride + h * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = load(x[i]), b = load(x[i + half]);
          // neox rotate_half: [a, b] -> [a cos - b sin, b cos + a sin]
          store(x[i], a * c[i] - b * s[i]);
          store(x[i + half], b * c[i + half] + a * s[i + half]);
        }
      }
    }
  });
}

}  // namespace

// Rotary embedding in place on the first `heads` heads of each row of qkv [tokens, *]
// (the query and key heads of a fused projection), with fp32 cos/sin rows per token.
void rotary_embedding(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                      int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= heads * head_dim,
              "rotary_embedding: qkv rows [tokens, >= heads * head_dim]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == qkv.size(0) &&
                  cos.size(-1) == head_dim && cos.sizes() == sin.sizes(),
              "rotary_embedding: contiguous fp32 cos/sin [tokens, head_dim]");
  if (qkv.scalar_type() == at::kFloat)
    rotate_rows<float>(kvscope::elements<float>(qkv), qkv.stride(0), kvscope::elements<float>(cos),
                       kvscope::elements<float>(sin), qkv.size(0), heads, head_dim);
  else
    rotate_rows<kvscope::bf16>(kvscope::elements<kvscope::bf16>(qkv), qkv.stride(0),
                               kvscope::elements<float>(cos), kvscope::elements<float>(sin),
                               qkv.size(0), heads, head_dim);
}

namespace {

template <typename T>
void silu_mul_rows(const T* x, int64_t x_stride, T* out, int64_t out_stride, int64_t rows,
                   int64_t width) {
  kvscope::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * x_stride;
      const T* up = gate + width;
      T* y = out + r * out_stride;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float g = load(gate[i]);
        // sigmoid(g) from e = exp(-|g|), which never overflows: 1/(1+e) or e/(1+e)
        const float e = kvscope::exp_nonpositive(-std::abs(g));
        const float sigmoid = (g >= 0.f ? 1.f : e) / (1.f + e);
        const float silu = round_to(g * sigmoid, static_cast<T*>(nullptr));
        store(y[i], silu * load(up[i]));
      }
    }
  });
}

}  // namespace

// out = silu(gate) * up for x = [gate | up] rows [tokens, 2 * width].
void silu_and_mul(const at::Tensor& x, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 &&
                  x.size(1) == 2 * out.size(1) && out.scalar_type() == x.scalar_type(),
              "silu_and_mul: x [tokens, 2 * width] -> out [tokens, width]");
  if (x.scalar_type() == at::kFloat)
    silu_mul_rows<float>(kvscope::elements<float>(x), x.stride(0), kvscope::elements<float>(out),
                         out.stride(0), x.size(0), out.size(1));
  else
    silu_mul_rows<kvscope::bf16>(kvscope::elements<kvscope::bf16>(x), x.stride(0),
                                 kvscope::elements<kvscope::bf16>(out), out.stride(0), x.size(0),
                                 out.size(1));
}
