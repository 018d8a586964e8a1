// A Llama-family decoder stack (every layer, then the final norm) as one call on the CPU.
// It chains the same C++ ops the Python layers call one by one (cpu_ops.h), in the same
// order and with the same roundings, so its output matches theirs; what it removes is the
// Python between them: a decode step of a small model spends milliseconds dispatching
// ~300 module and op calls, as much as some of its matmuls take.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <optional>

namespace {

constexpr int64_t kWeightsPerLayer = 6;  // input norm, qkv, o, post-attention norm, gate_up, down
constexpr int64_t kLinearsPerLayer = 4;  // qkv, o, gate_up, down: a bias, scales, offsets each
constexpr int64_t kLinearWeight[kLinearsPerLayer] = {1, 2, 4, 5};  // their places in weights

// Calls `op` inside a profiler range named like the op's own registration, so a profile of
// the stack reads as a profile of the layers (torch.profiler sees no dispatcher calls here).
template <typename Op>
auto traced(const char* name, Op&& op) {
  RECORD_FUNCTION(name, std::vector<c10::IValue>());
  return op();
}

// A linear layer's tensors: a dense weight, or a packed int4 (uint8) / int8 one with its
// scales (and int4 offsets) as engine/models/quantized.py packs them.
struct LinearWeights {
  const at::Tensor& weight;
  std::optional<at::Tensor> bias, scales, offsets;
  int64_t group_size;
  int64_t kernel_max_rows;  // packed weights: up to this many rows stream through a kernel
};

at::Tensor quantized_project(const at::Tensor& x, const LinearWeights& linear) {
  const bool int4 = linear.weight.scalar_type() == at::kByte;
  const int64_t out_features = linear.weight.size(0);
  if (x.size(0) <= linear.kernel_max_rows) {
    at::Tensor out = at::empty({x.size(0), out_features}, x.options());
    if (int4)
      traced("kvscope::int4_linear", [&] {
        int4_linear(x, linear.weight, *linear.scales, *linear.offsets, linear.group_size,
                    linear.bias, out);
      });
    else
      traced("kvscope::int8_linear",
             [&] { int8_linear(x, linear.weight, *linear.scales, linear.bias, out); });
    return out;
  }
  // Many rows are compute-bound: de-quantize once for a GEMM.
  at::Tensor dense = at::empty({out_features, x.size(1)}, x.options());
  if (int4)
    traced("kvscope::int4_dequantize", [&] {
      int4_dequantize(linear.weight, *linear.scales, *linear.offsets, linear.group_size, dense);
    });
  else
    traced("kvscope::int8_dequantize",
           [&] { int8_dequantize(linear.weight, *linear.scales, dense); });
  return at::linear(x, dense, linear.bias);
}

// Dense weights: one row streams its weights through the dot-product kernel, more rows go to
// oneDNN's GEMM (as kernels/forward_ops.py's linear does); packed ones as their modules do.
at::Tensor project(const at::Tensor& x, const LinearWeights& linear) {
  if (linear.scales) return quantized_project(x, linear);
  if (x.size(0) != 1) return at::linear(x, linear.weight, linear.bias);
  at::Tensor out = at::empty({1, linear.weight.size(0)}, x.options());
  traced("kvscope::linear_small_batch",
         [&] { linear_small_batch(x, linear.weight, linear.bias, out); });
  return out;
}

at::Tensor normed(const at::Tensor& hidden, const at::Tensor& weight, double eps,
                  const std::optional<at::Tensor>& residual) {
  at::Tensor out = at::empty_like(hidden);
  traced("kvscope::rms_norm", [&] { rms_norm(hidden, weight, eps, out, residual); });
  return out;
}

}  // namespace

// hidden: the token embeddings [tokens, hidden_size], used as the residual stream (updated
// in place). weights: kWeightsPerLayer per layer; biases, scales and offsets:
// kLinearsPerLayer per layer (None where a projection has none; scales only for packed
// weights, offsets only for int4). Returns the final norm's output.
at::Tensor llama_decoder_stack(
    at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
    const c10::List<std::optional<at::Tensor>>& biases,
    const c10::List<std::optional<at::Tensor>>& scales,
    const c10::List<std::optional<at::Tensor>>& offsets, int64_t group_size,
    int64_t kernel_max_rows, at::TensorList key_caches, at::TensorList value_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, const at::Tensor& final_norm, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps, double scale) {
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  const int64_t linears = layers * kLinearsPerLayer;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer &&
              static_cast<int64_t>(biases.size()) == linears &&
              static_cast<int64_t>(scales.size()) == linears &&
              static_cast<int64_t>(offsets.size()) == linears &&
              static_cast<int64_t>(value_caches.size()) == layers,
              "llama_decoder_stack: ", kWeightsPerLayer, " weights, ", kLinearsPerLayer,
              " biases, scales and offsets, and one K and V cache per layer");
  const int64_t tokens = hidden.size(0);
  const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
  at::Tensor residual = hidden;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    auto linear = [&](int64_t index) {
      const int64_t at = layer * kLinearsPerLayer + index;
      return LinearWeights{w[kLinearWeight[index]], biases.get(at), scales.get(at),
                           offsets.get(at), group_size, kernel_max_rows};
    };
    // The first layer's norm reads the embeddings; later ones first add the previous
    // layer's output into the residual stream.
    at::Tensor x = normed(hidden, w[0], eps,
                          layer == 0 ? std::nullopt : std::optional<at::Tensor>(residual));
    at::Tensor qkv = project(x, linear(0));
    traced("kvscope::rotary_embedding",
           [&] { rotary_embedding(qkv, cos, sin, num_heads + num_kv_heads, head_dim); });
    at::Tensor query = qkv.narrow(1, 0, q_width).view({tokens, num_heads, head_dim});
    at::Tensor key = qkv.narrow(1, q_width, kv_width).view({tokens, num_kv_heads, head_dim});
    at::Tensor value = qkv.narrow(1, q_width + kv_width, kv_width)
                           .view({tokens, num_kv_heads, head_dim});
    traced("kvscope::store_kv", [&] {
      store_kv(key, value, key_caches[layer], value_caches[layer], slot_mapping);
    });
    at::Tensor attended = at::empty({tokens, num_heads, head_dim}, query.options());
    traced("kvscope::paged_attention", [&] {
      paged_attention(query, key_caches[layer], value_caches[layer], block_tables, seq_lens,
                      query_start_loc, scale, attended);
    });
    hidden = project(attended.view({tokens, q_width}), linear(1));
    x = normed(hidden, w[3], eps, residual);
    at::Tensor gate_up = project(x, linear(2));
    at::Tensor activated = at::empty({tokens, gate_up.size(1) / 2}, gate_up.options());
    traced("kvscope::silu_and_mul", [&] { silu_and_mul(gate_up, activated); });
    hidden = project(activated, linear(3));
  }
  return normed(hidden, final_norm, eps, residual);
}

TORCH_LIBRARY_FRAGMENT(kvscope, m) {
  m.def("llama_decoder_stack(Tensor(a!) hidden, Tensor cos, Tensor sin, Tensor[] weights, "
        "Tensor?[] biases, Tensor?[] scales, Tensor?[] offsets, int group_size, "
        "int kernel_max_rows, Tensor(b!)[] key_caches, Tensor(c!)[] value_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
        "Tensor final_norm, int num_heads, int num_kv_heads, int head_dim, float eps, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) { m.impl("llama_decoder_stack", &llama_decoder_stack); }
