// A Llama-family decoder stack (the token embedding and rotary lookups, every layer, then the
// final norm) as one call on the CPU, and the output projection (the logits) as another:
// kvscope.LlamaDecoderStack, registered in bindings.cpp.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kvscope {

// A tensor dictionary from Python (module parameter names to tensors), read by name.
using NamedTensors = c10::Dict<std::string, at::Tensor>;

// A linear layer's tensors: a dense weight, or a packed int4 (uint8) / int8 one with its
// scales (and int4 offsets) as engine/worker/models/quantized.py packs them. A dense bf16
// weight prepacked for oneDNN (kernels/cpu_kernels.py's prepack_weight) comes as its opaque
// oneDNN tensor `onednn`, with `weight` the same memory as bf16 blocks.
struct LinearWeights {
  at::Tensor weight;
  std::optional<at::Tensor> bias, scales, offsets, onednn;

  int64_t out_features() const { return (onednn ? *onednn : weight).size(0); }
};

// One decoder layer's weights, named as the module's parameters are
// (engine/worker/models/llama.py's LlamaDecoderLayer). A weight the model's config leaves
// out is absent, and so is its step.
struct DecoderLayerWeights {
  at::Tensor input_layernorm;
  LinearWeights qkv_proj, o_proj;
  std::optional<at::Tensor> q_norm, k_norm;  // RMSNorm per query / key head (Qwen3)
  at::Tensor post_attention_layernorm;
  LinearWeights gate_up_proj, down_proj;

  // From the layer's named_parameters(); every name must be one of the above.
  static DecoderLayerWeights from(const NamedTensors& named);
};

// A layer's options that are no weight, from the model's config, one set per layer (models
// mix layer kinds), named as engine/worker/models/llama.py's LlamaDecoderLayer.stack_options
// names them. A new kind of layer adds a field here and its name in from().
struct LayerOptions {
  bool rotary = true;          // false: no rotary embedding (SmolLM3's NoPE layers)
  int64_t sliding_window = 0;  // > 0: attend to the last sliding_window positions only
  int64_t kv_group = 0;        // which KV cache group's slot mapping and block tables it uses

  // Every name must be one of the above.
  static LayerOptions from(const c10::Dict<std::string, int64_t>& named);
};

struct StackConfig {
  int64_t num_heads, num_kv_heads, head_dim;
  int64_t group_size;       // inputs per scale of int4 weights (0 without them)
  int64_t kernel_max_rows;  // packed weights: up to this many rows stream through a kernel
  double eps;               // the RMS norms'
  double attention_scale;
};

}  // namespace kvscope

// A model's decoder layers bound once: the weights cross from Python when the model is
// loaded; a step passes only its own inputs (converting every weight to call arguments
// would cost every step more than some of its ops).
class LlamaDecoderStack : public torch::CustomClassHolder {
 public:
  // embedding: the token embedding table, dense or int8 with embedding_scales (one per row);
  // head, head_scales: the output projection alike (the embedding's own when they are tied);
  // cos, sin: the rotary tables, a row per position (of the rotated width: partial rotary
  // rotates each head's first dims); layers: each decoder layer's named_parameters();
  // layer_options: each layer's LayerOptions by name.
  LlamaDecoderStack(at::Tensor embedding, std::optional<at::Tensor> embedding_scales,
                    at::Tensor head, std::optional<at::Tensor> head_scales, at::Tensor cos,
                    at::Tensor sin, at::Tensor final_norm,
                    const c10::List<kvscope::NamedTensors>& layers,
                    const c10::List<c10::Dict<std::string, int64_t>>& layer_options,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t group_size,
                    int64_t kernel_max_rows, double eps, double attention_scale);

  // input_ids, positions: int64 [tokens]; one K and one V cache per layer; slot_mapping
  // [groups, tokens] and block_tables [groups, seqs, blocks]: one of each per KV cache group
  // (engine/core/kv_groups.py), a layer reading its LayerOptions::kv_group's. The embeddings
  // become the residual stream (updated in place). Returns the final norm's output.
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions,
                     const std::vector<at::Tensor>& key_caches,
                     const std::vector<at::Tensor>& value_caches, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc) const;

  // hidden @ head.T in fp32 [rows, vocab], each value rounded to hidden's dtype first, as
  // engine/worker/models/quantized.output_logits computes it from Python (the same paths,
  // with an fp32 out). Called right after the stack, when the Python and ops around the head
  // would cost more than the call.
  at::Tensor logits(const at::Tensor& hidden) const;

 private:
  at::Tensor embed(const at::Tensor& ids) const;

  at::Tensor embedding_;
  std::optional<at::Tensor> embedding_scales_;
  kvscope::LinearWeights head_;
  at::Tensor cos_, sin_, final_norm_;
  std::vector<kvscope::DecoderLayerWeights> layers_;
  std::vector<kvscope::LayerOptions> options_;
  kvscope::StackConfig config_;
};
