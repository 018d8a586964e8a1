// Fused CPU ops for the Llama-family forward: each replaces several small eager ops (whose
// dispatch costs more than their math at decode batch sizes) with one pass over the data.
// Every op computes in fp32 and rounds to the tensor's dtype where the eager code rounds.
#include <ATen/core/Tensor.h>

#include <algorithm>
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

// Row r of a [tokens, heads, width] tensor (heads 1 for plain rows) with these strides.
struct RowLayout {
  int64_t heads, token_stride, head_stride;

  int64_t offset(int64_t r) const { return (r / heads) * token_stride + (r % heads) * head_stride; }
};

template <typename T>
void rms_norm_rows(T* hidden, RowLayout hidden_rows, T* residual, int64_t residual_stride,
                   const T* weight, T* out, RowLayout out_rows, int64_t rows, int64_t width,
                   float eps, bool unit_offset) {
  kvscope::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(width);
    for (int64_t r = begin; r < end; ++r) {
      const T* x = hidden + hidden_rows.offset(r);
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
      // The row is read whole before it is written, so out may be hidden itself.
      const float inverse = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
      T* y = out + out_rows.offset(r);
      if (unit_offset) {  // Gemma: (x / rms) * (1 + weight) in fp32, rounded once
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) store(y[i], row[i] * inverse * (1.f + load(weight[i])));
      } else {  // Llama: weight * (x / rms rounded to T)
#pragma omp simd
        for (int64_t i = 0; i < width; ++i)
          store(y[i], load(weight[i]) * round_to(row[i] * inverse, static_cast<T*>(nullptr)));
      }
    }
  });
}

// A [tokens, width] or [tokens, heads, width] tensor's rows (the per-head q/k norms of
// Qwen3 read the heads of a fused projection's rows in place).
RowLayout row_layout(const at::Tensor& x) {
  if (x.dim() == 2) return {1, x.stride(0), 0};
  return {x.size(1), x.stride(0), x.stride(1)};
}

}  // namespace

// out = weight * rms_norm(hidden) over the last dim of [tokens, width] or [tokens, heads,
// width] rows (out may be hidden: in place); with a residual (2-D only), first residual +=
// hidden and normalise the sum (the residual stream then holds it for the next layer).
// unit_offset: out = (1 + weight) * rms_norm(hidden), as Gemma's norms scale.
void rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps, at::Tensor out,
              std::optional<at::Tensor> residual, bool unit_offset) {
  TORCH_CHECK((hidden.dim() == 2 || (hidden.dim() == 3 && !residual)) &&
                  hidden.sizes() == out.sizes() && hidden.stride(-1) == 1 && out.stride(-1) == 1,
              "rms_norm: rows [tokens, hidden] or [tokens, heads, head_dim] (no residual) with "
              "contiguous features, out alike");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == hidden.scalar_type() &&
                  out.scalar_type() == hidden.scalar_type() && weight.numel() == hidden.size(-1),
              "rms_norm: one dtype for all, a weight per feature");
  const int64_t width = hidden.size(-1), rows = hidden.numel() / std::max<int64_t>(width, 1);
  if (residual)
    TORCH_CHECK(residual->stride(1) == 1 && residual->scalar_type() == hidden.scalar_type(),
                "rms_norm: residual layout");
  const RowLayout hidden_rows = row_layout(hidden), out_rows = row_layout(out);
  if (hidden.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(kvscope::elements<float>(hidden), hidden_rows,
                         residual ? kvscope::elements<float>(*residual) : nullptr,
                         residual ? residual->stride(0) : 0, kvscope::elements<float>(weight),
                         kvscope::elements<float>(out), out_rows, rows, width,
                         static_cast<float>(eps), unit_offset);
  } else {
    TORCH_CHECK(hidden.scalar_type() == at::kBFloat16, "rms_norm: float32 or bfloat16");
    using B = kvscope::bf16;
    rms_norm_rows<B>(kvscope::elements<B>(hidden), hidden_rows,
                     residual ? kvscope::elements<B>(*residual) : nullptr,
                     residual ? residual->stride(0) : 0, kvscope::elements<B>(weight),
                     kvscope::elements<B>(out), out_rows, rows, width, static_cast<float>(eps),
                     unit_offset);
  }
}

namespace {

// cos / sin rows hold `rotary_dim` values (the rotated part of each head, which partial
// rotary leaves shorter than the head); the rest of each head passes through unchanged.
template <typename T>
void rotate_rows(T* qkv, int64_t row_stride, const float* cos, const float* sin, int64_t tokens,
                 int64_t heads, int64_t head_dim, int64_t rotary_dim) {
  const int64_t half = rotary_dim / 2;
  kvscope::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * rotary_dim;
      const float* s = sin + t * rotary_dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qkv + t * row_stride + h * head_dim;
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
// (the query and key heads of a fused projection), with fp32 cos/sin rows per token of the
// rotated width: head_dim, or less for partial rotary (the first dims of each head).
void rotary_embedding(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                      int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= heads * head_dim,
              "rotary_embedding: qkv rows [tokens, >= heads * head_dim]");
  const int64_t rotary_dim = cos.size(-1);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == qkv.size(0) &&
                  rotary_dim <= head_dim && rotary_dim % 2 == 0 && cos.sizes() == sin.sizes(),
              "rotary_embedding: contiguous fp32 cos/sin [tokens, rotary_dim <= head_dim, even]");
  if (qkv.scalar_type() == at::kFloat)
    rotate_rows<float>(kvscope::elements<float>(qkv), qkv.stride(0), kvscope::elements<float>(cos),
                       kvscope::elements<float>(sin), qkv.size(0), heads, head_dim, rotary_dim);
  else
    rotate_rows<kvscope::bf16>(kvscope::elements<kvscope::bf16>(qkv), qkv.stride(0),
                               kvscope::elements<float>(cos), kvscope::elements<float>(sin),
                               qkv.size(0), heads, head_dim, rotary_dim);
}

namespace {

// The gates of gated MLPs, per fp32 element: SwiGLU's silu (Llama) and GeGLU's tanh-approximated
// gelu (Gemma), each from exp_nonpositive, which never overflows and vectorizes.
struct Silu {
  static float apply(float g) { return kvscope::silu(g); }
};

struct GeluTanh {
  static float apply(float g) {
    // 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), as torch's approximate="tanh";
    // tanh(|u|) = (1 - e) / (1 + e) with e = exp(-2|u|)
    const float u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    const float e = kvscope::exp_nonpositive(-2.f * std::abs(u));
    const float tanh_abs = (1.f - e) / (1.f + e);
    return 0.5f * g * (1.f + (u >= 0.f ? tanh_abs : -tanh_abs));
  }
};

template <typename Gate, typename T>
void gated_rows(const T* x, int64_t x_stride, T* out, int64_t out_stride, int64_t rows,
                int64_t width) {
  kvscope::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * x_stride;
      const T* up = gate + width;
      T* y = out + r * out_stride;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float activated = round_to(Gate::apply(load(gate[i])), static_cast<T*>(nullptr));
        store(y[i], activated * load(up[i]));
      }
    }
  });
}

// out = gate(x[:, :width]) * x[:, width:] for x = [gate | up] rows [tokens, 2 * width].
template <typename Gate>
void gate_and_mul(const char* name, const at::Tensor& x, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 &&
                  x.size(1) == 2 * out.size(1) && out.scalar_type() == x.scalar_type(),
              name, ": x [tokens, 2 * width] -> out [tokens, width]");
  if (x.scalar_type() == at::kFloat)
    gated_rows<Gate, float>(kvscope::elements<float>(x), x.stride(0), kvscope::elements<float>(out),
                            out.stride(0), x.size(0), out.size(1));
  else
    gated_rows<Gate, kvscope::bf16>(kvscope::elements<kvscope::bf16>(x), x.stride(0),
                                    kvscope::elements<kvscope::bf16>(out), out.stride(0), x.size(0),
                                    out.size(1));
}

}  // namespace

void silu_and_mul(const at::Tensor& x, at::Tensor out) {
  gate_and_mul<Silu>("silu_and_mul", x, out);
}

void gelu_tanh_and_mul(const at::Tensor& x, at::Tensor out) {
  gate_and_mul<GeluTanh>("gelu_tanh_and_mul", x, out);
}
