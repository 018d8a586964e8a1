// A Llama-family or Gemma 2/3 decoder stack (the token embedding and rotary lookups, every
// layer, then the final norm) as one call on the CPU, and the output projection (the logits)
// as another: kvscope.LlamaDecoderStack, registered in bindings.cpp.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moe.h"
#include "project.h"

namespace kvscope {

// A tensor dictionary from Python (module parameter names to tensors), read by name.
using NamedTensors = c10::Dict<std::string, at::Tensor>;

// A mixture-of-experts MLP's weights (engine/worker/models/moe.py's SparseMoeBlock): the router
// (mlp.gate), every routed expert's projections stacked (moe.h), and Qwen2-MoE's shared
// expert with its sigmoid gate.
struct MoeWeights {
  LinearWeights router;
  ExpertLinears gate_up, down;
  std::optional<LinearWeights> shared_gate_up, shared_down, shared_gate;
  // Where each step's tokens per expert go (int64 [experts]: the model runner's record).
  std::optional<at::Tensor> expert_counts;
};

// One decoder layer's weights, named as the module's parameters are
// (engine/worker/models/llama.py's LlamaDecoderLayer, gemma.py's GemmaDecoderLayer). A
// weight the model's config leaves out is absent, and so is its step.
struct DecoderLayerWeights {
  // The norm before attention; absent in Olmo 3, whose attention reads the residual stream.
  std::optional<at::Tensor> input_layernorm;
  LinearWeights qkv_proj, o_proj;
  // RMSNorm of the queries and keys: per head where the weight is head_dim wide (Qwen3,
  // Gemma 3), over the whole projection where it is as wide as that (Olmo 3, OLMoE).
  std::optional<at::Tensor> q_norm, k_norm;
  std::optional<at::Tensor> sinks;  // fp32 [heads]: the attention's sink logits (gpt-oss)
  // Gemma and Olmo 3 normalise the attention's and the MLP's outputs before each joins the
  // residual stream (their post_attention_layernorm and post_feedforward_layernorm).
  std::optional<at::Tensor> attention_output_norm, mlp_output_norm;
  // The norm before the MLP: Llama's post_attention_layernorm, Gemma's
  // pre_feedforward_layernorm; absent in Olmo 3, whose MLP reads the residual stream.
  std::optional<at::Tensor> mlp_input_norm;
  LinearWeights gate_up_proj, down_proj;  // a dense MLP's
  std::optional<MoeWeights> moe;          // a mixture-of-experts MLP's, in their place

  // From the layer's named_parameters(); every name must be one of the above.
  static DecoderLayerWeights from(const NamedTensors& named);
};

// A layer's options that are no weight, from the model's config, one set per layer (models
// mix layer kinds), named as engine/worker/models/llama.py's LlamaDecoderLayer.stack_options
// names them. A new kind of layer adds a field here and its name in from().
struct LayerOptions {
  bool rotary = true;          // false: no rotary embedding (SmolLM3's NoPE layers)
  int64_t rotary_table = 0;    // which of the stack's cos/sin tables (Gemma 3: per layer type)
  int64_t sliding_window = 0;  // > 0: attend to the last sliding_window positions only
  int64_t kv_group = 0;        // which KV cache group's slot mapping and block tables it uses
  // A mixture-of-experts layer's routing (engine/worker/models/moe.py's MoeConfig): its top_k
  // (0 on a dense layer), the top-k rescaled to sum to 1, the weights rounded to the model's
  // dtype.
  int64_t top_k = 0;
  bool normalize_top_k = false, round_weights = false;
  // Its experts' activation, as kernel_ops.EXPERT_ACTIVATIONS indexes it (0: silu).
  ExpertActivation expert_activation = ExpertActivation::kSilu;

  // Every name must be one of the above.
  static LayerOptions from(const c10::Dict<std::string, int64_t>& named);
};

// The model's options that are no weight and hold for every layer, named as
// engine/worker/models/gemma.py's GemmaForCausalLM.stack_options names them; a Llama-family
// model passes none (every default below).
struct ModelOptions {
  double embedding_scale = 0.;     // > 0: the embeddings times it, rounded to their dtype first
  bool norm_unit_offset = false;   // every norm scales by (1 + weight) (Gemma's RMSNorm)
  bool gelu_tanh = false;          // the MLP's gate is tanh-approximated gelu (GeGLU), not silu
  double attention_soft_cap = 0.;  // > 0: scores become cap * tanh(score / cap) (Gemma 2)
  double final_soft_cap = 0.;      // > 0: logits alike (Gemma 2)
  // The GGUF type of the embedding's and the output projection's blocks (a GGUF file's
  // token_embd and output tensors, as uint8 rows); -1: not GGUF blocks.
  int64_t embedding_gguf_type = -1, head_gguf_type = -1;
  // The outputs per tile of the embedding's and the output projection's tables where they are
  // kept only in tiles (engine/worker/models/layers.py's prepack_weights: a tied one is both);
  // 0: plain.
  int64_t embedding_tile = 0, head_tile = 0;

  // Every name must be one of the above (booleans as 0 or 1).
  static ModelOptions from(const c10::Dict<std::string, double>& named);
};

struct StackConfig {
  int64_t num_heads, num_kv_heads, head_dim;
  int64_t group_size;       // inputs per scale of int4 weights (0 without them)
  int64_t kernel_max_rows;  // packed weights: up to this many rows stream through a kernel
  double eps;               // the RMS norms'
  double attention_scale;
  ModelOptions model;

  ProjectLimits limits() const { return {group_size, kernel_max_rows}; }
};

}  // namespace kvscope

// A model's decoder layers bound once: the weights cross from Python when the model is
// loaded; a step passes only its own inputs (converting every weight to call arguments
// would cost every step more than some of its ops).
class LlamaDecoderStack : public torch::CustomClassHolder {
 public:
  // embedding: the token embedding table, dense or int8 with embedding_scales (one per row);
  // head, head_scales: the output projection alike (the embedding's own when they are tied);
  // cos, sin: the rotary tables (one pair, or one per rope base), a row per position (of the
  // rotated width: partial rotary rotates each head's first dims); query_scale: fp32
  // [positions, 1], each position's query scale after the rotary (Ministral 3), or none;
  // layers: each decoder
  // layer's named_parameters(); layer_options: each layer's LayerOptions by name;
  // model_options: the ModelOptions by name.
  LlamaDecoderStack(at::Tensor embedding, std::optional<at::Tensor> embedding_scales,
                    at::Tensor head, std::optional<at::Tensor> head_scales,
                    std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                    std::optional<at::Tensor> query_scale, at::Tensor final_norm,
                    const c10::List<kvscope::NamedTensors>& layers,
                    const c10::List<c10::Dict<std::string, int64_t>>& layer_options,
                    const c10::Dict<std::string, double>& model_options, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t group_size,
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
  // with an fp32 out), then soft-capped where the model caps them. Called right after the
  // stack, when the Python and ops around the head would cost more than the call.
  at::Tensor logits(const at::Tensor& hidden) const;

 private:
  at::Tensor embed(const at::Tensor& ids) const;

  at::Tensor embedding_;
  std::optional<at::Tensor> embedding_scales_;
  kvscope::LinearWeights head_;
  std::vector<at::Tensor> cos_, sin_;
  std::optional<at::Tensor> query_scale_;
  at::Tensor final_norm_;
  std::vector<kvscope::DecoderLayerWeights> layers_;
  std::vector<kvscope::LayerOptions> options_;
  kvscope::StackConfig config_;
};
