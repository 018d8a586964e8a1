// The depthwise causal convolution of Qwen3.5's Gated DeltaNet and LFM2's short-conv layers
// over a pool of windows, one slot per sequence (contract: kernels/reference.py
// causal_conv1d_prefill / _decode). A slot holds the W-1 inputs before the next one, channel
// by channel [C, W-1]; y[t, c] = bias[c] + sum_j weight[c, j] in[t - (W-1) + j, c], then
// silu if asked, in fp32, rounded once to x's dtype.
//
// The loops run over channels, W (4 in both models) times per output: each output reads only
// its own W inputs, so there is nothing to block; the rows of x are contiguous channels, which
// the compiler vectorizes.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "work_pool.h"

namespace {

using kvscope::load;
using kvscope::store;

// Channels a chunk of the work pool takes: a few cache lines of every row.
constexpr int64_t kChannelGrain = 256;

inline float activate(float y, bool silu) { return silu ? kvscope::silu(y) : y; }

// Sequence b's new input x[b] [C] against its window in state[slots[b]].
template <typename T, typename S>
void decode(const T* x, int64_t x_stride, S* state, const int64_t* slots, int64_t batch,
            int64_t channels, int64_t width, const T* weight, const T* bias, bool silu, T* out) {
  const int64_t window = width - 1;
  kvscope::parallel_for(0, batch * channels, kChannelGrain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / channels, c = item % channels;
      S* held = state + (slots[b] * channels + c) * window;
      const T* w = weight + c * width;
      const float input = load(x[b * x_stride + c]);
      float y = bias != nullptr ? load(bias[c]) : 0.f;
      for (int64_t j = 0; j < window; ++j) y += load(w[j]) * load(held[j]);
      y += load(w[window]) * input;
      for (int64_t j = 0; j + 1 < window; ++j) held[j] = held[j + 1];
      store(held[window - 1], input);
      store(out[b * channels + c], activate(y, silu));
    }
  });
}

// One sequence's T inputs x [T, C]. Each chunk of channels takes its weights transposed to
// [W, channels] and its windows as fp32 rows [W-1, channels], so that every input row it reads,
// from the window or from x, has its channels contiguous; it runs the rows in order and writes
// its windows back.
template <typename T, typename S>
void prefill(const T* x, int64_t x_stride, S* state, int64_t slot, int64_t tokens, int64_t channels,
             int64_t width, const T* weight, const T* bias, bool silu, T* out) {
  const int64_t window = width - 1;
  S* windows = state + slot * channels * window;
  kvscope::parallel_for(0, channels, kChannelGrain, [&](int64_t begin, int64_t end) {
    const int64_t n = end - begin;
    std::vector<float> w(width * n), held(window * n), sum(n);
    for (int64_t c = 0; c < n; ++c) {
      for (int64_t j = 0; j < width; ++j) w[j * n + c] = load(weight[(begin + c) * width + j]);
      for (int64_t j = 0; j < window; ++j)
        held[j * n + c] = load(windows[(begin + c) * window + j]);
    }
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t c = 0; c < n; ++c) sum[c] = bias != nullptr ? load(bias[begin + c]) : 0.f;
      for (int64_t j = 0; j < width; ++j) {
        const float* wj = w.data() + j * n;
        const int64_t row = t - window + j;  // x's row, or before it: the window's row + W-1
        if (row >= 0) {
          const T* in = x + row * x_stride + begin;
#pragma omp simd
          for (int64_t c = 0; c < n; ++c) sum[c] += wj[c] * load(in[c]);
        } else {
          const float* in = held.data() + (row + window) * n;
#pragma omp simd
          for (int64_t c = 0; c < n; ++c) sum[c] += wj[c] * in[c];
        }
      }
      T* y = out + t * channels + begin;
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) store(y[c], activate(sum[c], silu));
    }
    // The new window: the last W-1 inputs of (old window ++ x).
    for (int64_t j = 0; j < window; ++j) {
      const int64_t row = tokens - window + j;
      for (int64_t c = 0; c < n; ++c)
        store(windows[(begin + c) * window + j],
              row >= 0 ? load(x[row * x_stride + begin + c]) : held[(row + window) * n + c]);
    }
  });
}

struct Checked {
  int64_t channels, width;
  bool silu;
};

Checked check(const char* name, const at::Tensor& x, const at::Tensor& state,
              const at::Tensor& weight, const std::optional<at::Tensor>& bias,
              const std::string& activation, const at::Tensor& out) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) >= 2, name,
              ": weight contiguous [channels, width >= 2]");
  const int64_t channels = weight.size(0), width = weight.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == channels && x.stride(1) == 1, name,
              ": x [rows, channels] with contiguous channels");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && out.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              name, ": x, weight and out in one dtype, float32 or bfloat16");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == channels &&
                        bias->scalar_type() == x.scalar_type()),
              name, ": bias contiguous [channels] in x's dtype");
  TORCH_CHECK(state.dim() == 3 && state.is_contiguous() && state.size(1) == channels &&
                  state.size(2) == width - 1 &&
                  (state.scalar_type() == at::kFloat || state.scalar_type() == x.scalar_type()),
              name, ": conv_state contiguous [slots, channels, width - 1], float32 or x's dtype");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes(), name, ": out contiguous, x's shape");
  TORCH_CHECK(activation.empty() || activation == "silu", name, ": activation none or silu");
  return {channels, width, activation == "silu"};
}

// body(T{}, S{}) for x's dtype T and the state's S.
template <typename Body>
void with_types(const at::Tensor& x, const at::Tensor& state, Body&& body) {
  const bool float_state = state.scalar_type() == at::kFloat;
  if (x.scalar_type() == at::kFloat)
    body(float{}, float{});
  else if (float_state)
    body(kvscope::bf16{}, float{});
  else
    body(kvscope::bf16{}, kvscope::bf16{});
}

}  // namespace

void causal_conv1d_decode(const at::Tensor& x, at::Tensor conv_state, const at::Tensor& slots,
                          const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const std::string& activation, at::Tensor out) {
  const Checked shape = check("causal_conv1d_decode", x, conv_state, weight, bias, activation, out);
  TORCH_CHECK(
      slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == x.size(0),
      "causal_conv1d_decode: slots contiguous int64, one per row");
  const int64_t* slot_ids = kvscope::elements<const int64_t>(slots);
  for (int64_t b = 0; b < slots.numel(); ++b)
    TORCH_CHECK(slot_ids[b] >= 0 && slot_ids[b] < conv_state.size(0),
                "causal_conv1d_decode: slots[", b, "] = ", slot_ids[b], " outside the pool's ",
                conv_state.size(0), " slots");
  with_types(x, conv_state, [&](auto t, auto s) {
    using T = decltype(t);
    using S = decltype(s);
    decode<T, S>(
        kvscope::elements<const T>(x), x.stride(0), kvscope::elements<S>(conv_state), slot_ids,
        x.size(0), shape.channels, shape.width, kvscope::elements<const T>(weight),
        bias ? kvscope::elements<const T>(*bias) : nullptr, shape.silu, kvscope::elements<T>(out));
  });
}

void causal_conv1d_prefill(const at::Tensor& x, at::Tensor conv_state, int64_t slot,
                           const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           const std::string& activation, at::Tensor out) {
  const Checked shape =
      check("causal_conv1d_prefill", x, conv_state, weight, bias, activation, out);
  TORCH_CHECK(slot >= 0 && slot < conv_state.size(0), "causal_conv1d_prefill: slot ", slot,
              " outside the pool's ", conv_state.size(0), " slots");
  with_types(x, conv_state, [&](auto t, auto s) {
    using T = decltype(t);
    using S = decltype(s);
    prefill<T, S>(kvscope::elements<const T>(x), x.stride(0), kvscope::elements<S>(conv_state),
                  slot, x.size(0), shape.channels, shape.width, kvscope::elements<const T>(weight),
                  bias ? kvscope::elements<const T>(*bias) : nullptr, shape.silu,
                  kvscope::elements<T>(out));
  });
}
