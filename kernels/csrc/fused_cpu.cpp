// Fused CPU ops for the Llama-family forward: each replaces several small eager ops (whose
// dispatch costs more than their math at decode batch sizes) with one pass over the data.
// Every op computes in fp32 and rounds to the tensor's dtype where the eager code rounds.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "work_pool.h"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

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
      // dependent add per element made a 576-wide norm cost ~1.5 us, 61 of them per token.
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
              out.scalar_type() == hidden.scalar_type(), "rms_norm: one dtype for all");
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  if (residual) TORCH_CHECK(residual->stride(1) == 1 && residual->scalar_type() == hidden.scalar_type(), "rms_norm: residual layout");
  if (hidden.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(kvscope::elements<float>(hidden), hidden.stride(0),
                         residual ? kvscope::elements<float>(*residual) : nullptr,
                         residual ? residual->stride(0) : 0, kvscope::elements<float>(weight),
                         kvscope::elements<float>(out), out.stride(0), rows, width, static_cast<float>(eps));
  } else {
    TORCH_CHECK(hidden.scalar_type() == at::kBFloat16, "rms_norm: float32 or bfloat16");
    using B = kvscope::bf16;
    rms_norm_rows<B>(kvscope::elements<B>(hidden), hidden.stride(0),
                     residual ? kvscope::elements<B>(*residual) : nullptr,
                     residual ? residual->stride(0) : 0, kvscope::elements<B>(weight),
                     kvscope::elements<B>(out), out.stride(0), rows, width, static_cast<float>(eps));
  }
}

namespace {

template <typename T>
void rotate_rows(T* qkv, int64_t row_stride, const float* cos, const float* sin,
                 int64_t tokens, int64_t heads, int64_t dim) {
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
void rotary_embedding(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                      int64_t heads, int64_t head_dim) {
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
                               kvscope::elements<float>(cos), kvscope::elements<float>(sin), qkv.size(0),
                               heads, head_dim);
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

TORCH_LIBRARY_FRAGMENT(kvscope, m) {
  m.def("rms_norm(Tensor hidden, Tensor weight, float eps, Tensor(a!) out, "
        "Tensor(b!)? residual) -> ()");
  m.def("rotary_embedding(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads, "
        "int head_dim) -> ()");
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}

namespace {

// y[m, n] = x[m] . w[n] + bias[n] for a few rows m: every weight row is read from memory
// once, streamed, and dotted with all rows of x while it sits in L1.
// x . w over `size` elements. Independent partial sums: one vector accumulator would
// chain every FMA on the previous one, and that latency, not memory, would bound the
// weight stream.
template <typename T>
inline float dot_row(const float* __restrict x, const T* __restrict w, int64_t size) {
  constexpr int kLanes = 32;
  float partial[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= size; k += kLanes) {
#pragma omp simd
    for (int lane = 0; lane < kLanes; ++lane) partial[lane] += x[k + lane] * load(w[k + lane]);
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int lane = 0; lane < kLanes; ++lane) sum += partial[lane];
  for (; k < size; ++k) sum += x[k] * load(w[k]);
  return sum;
}

#if defined(__AVX512BF16__)
// bf16 x . bf16 w0 and x . w1 with vdpbf16ps: one instruction multiplies 32 pairs and adds
// them into 16 fp32 sums, so the weights need no widening to fp32 first. The products are
// exact in fp32, as in dot_row; only the order of the fp32 sums differs.
inline std::pair<float, float> dot_two_rows_bf16(const kvscope::bf16* __restrict x,
                                                 const kvscope::bf16* __restrict w0,
                                                 const kvscope::bf16* __restrict w1,
                                                 int64_t size) {
  auto pairs = [](const kvscope::bf16* p) { return (__m512bh)_mm512_loadu_si512(p); };
  __m512 first[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  __m512 second[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t k = 0;
  for (; k + 64 <= size; k += 64)
    for (int part = 0; part < 2; ++part) {
      const __m512bh xs = pairs(x + k + 32 * part);
      first[part] = _mm512_dpbf16_ps(first[part], xs, pairs(w0 + k + 32 * part));
      second[part] = _mm512_dpbf16_ps(second[part], xs, pairs(w1 + k + 32 * part));
    }
  if (k + 32 <= size) {
    const __m512bh xs = pairs(x + k);
    first[0] = _mm512_dpbf16_ps(first[0], xs, pairs(w0 + k));
    second[0] = _mm512_dpbf16_ps(second[0], xs, pairs(w1 + k));
    k += 32;
  }
  if (k < size) {  // the last < 32 elements, the rest of the vector zero
    const __mmask32 tail = (1u << (size - k)) - 1u;
    auto masked = [&](const kvscope::bf16* p) {
      return (__m512bh)_mm512_maskz_loadu_epi16(tail, p + k);
    };
    first[1] = _mm512_dpbf16_ps(first[1], masked(x), masked(w0));
    second[1] = _mm512_dpbf16_ps(second[1], masked(x), masked(w1));
  }
  return {_mm512_reduce_add_ps(_mm512_add_ps(first[0], first[1])),
          _mm512_reduce_add_ps(_mm512_add_ps(second[0], second[1]))};
}
#endif

// Out is T, or fp32 for bf16 T (logits): each value is rounded to T first either way, so an
// fp32 out holds exactly what converting the T result would give, without a pass for it.
template <typename T, typename Out>
void small_batch_linear(const T* x, int64_t x_stride, const T* weight, const T* bias, Out* out,
                        int64_t out_stride, int64_t rows, int64_t in_features,
                        int64_t out_features) {
  // dot_pair(m, w0, w1): row m of x . weight rows w0 and w1. A thread's share of the outputs
  // is read as two streams, from its first half and its second half side by side: two
  // streams keep more reads in flight than one, and one core read its weights at ~90 % of
  // its bandwidth so, against ~78 % row after row. An odd last row pairs with itself.
  // One share per thread: each share starts its two streams anew, and four per thread
  // (the pool's default) made a bf16 single stream's token ~4 % slower (in-process A/B of
  // decode steps). A helper that has not started leaves its share to the caller.
  auto each_output = [&](auto dot_pair) {
    kvscope::parallel_for(0, out_features,
                          std::max<int64_t>(64, kvscope::one_share_per_thread(out_features)),
                          [&](int64_t begin, int64_t end) {
      const int64_t half = (end - begin) / 2;
      auto write = [&](int64_t n, int64_t m, float sum) {
        const float value = sum + (bias != nullptr ? load(bias[n]) : 0.f);
        store(out[m * out_stride + n], round_to(value, static_cast<T*>(nullptr)));
      };
      for (int64_t i = 0; i < half; ++i) {
        const int64_t n0 = begin + i, n1 = begin + half + i;
        for (int64_t m = 0; m < rows; ++m) {
          const auto [sum0, sum1] = dot_pair(m, weight + n0 * in_features,
                                             weight + n1 * in_features);
          write(n0, m, sum0);
          write(n1, m, sum1);
        }
      }
      if ((end - begin) % 2 != 0) {
        const T* last = weight + (end - 1) * in_features;
        for (int64_t m = 0; m < rows; ++m) write(end - 1, m, dot_pair(m, last, last).first);
      }
    });
  };
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, kvscope::bf16>) {
    each_output([&](int64_t m, const T* w0, const T* w1) {
      return dot_two_rows_bf16(x + m * x_stride, w0, w1, in_features);
    });
    return;
  }
#endif
  std::vector<float> xf(rows * in_features);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t k = 0; k < in_features; ++k)
      xf[m * in_features + k] = load(x[m * x_stride + k]);
  each_output([&](int64_t m, const T* w0, const T* w1) {
    const float* row = xf.data() + m * in_features;
    return std::pair<float, float>(dot_row(row, w0, in_features), dot_row(row, w1, in_features));
  });
}

}  // namespace

// out = x @ weight.T + bias for x [rows, in] with few rows (decode batches). out has x's
// dtype, or is fp32 (bf16 x: the bf16 result widened, e.g. logits for the sampler).
void linear_small_batch(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() &&
              out.is_contiguous() && x.size(1) == weight.size(1) &&
              out.size(0) == x.size(0) && out.size(1) == weight.size(0),
              "linear_small_batch: x [rows, in], weight [out, in], out [rows, out]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() &&
              (out.scalar_type() == x.scalar_type() || out.scalar_type() == at::kFloat) &&
              (!bias || (bias->is_contiguous() && bias->scalar_type() == x.scalar_type())),
              "linear_small_batch: x, weight and bias of one dtype, out of it or fp32");
  auto run = [&](auto* typed_x, auto* typed_out) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed_x)>>;
    small_batch_linear<T>(typed_x, x.stride(0), kvscope::elements<T>(weight),
                          bias ? kvscope::elements<T>(*bias) : nullptr, typed_out, out.stride(0),
                          x.size(0), x.size(1), weight.size(0));
  };
  if (x.scalar_type() == at::kFloat)
    run(kvscope::elements<float>(x), kvscope::elements<float>(out));
  else if (out.scalar_type() == at::kFloat)
    run(kvscope::elements<kvscope::bf16>(x), kvscope::elements<float>(out));
  else
    run(kvscope::elements<kvscope::bf16>(x), kvscope::elements<kvscope::bf16>(out));
}

TORCH_LIBRARY_FRAGMENT(kvscope, m) {
  m.def("linear_small_batch(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) { m.impl("linear_small_batch", &linear_small_batch); }
