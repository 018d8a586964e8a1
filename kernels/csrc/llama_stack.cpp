// The decoder stack (llama_stack.h). It chains the same C++ ops the Python layers call one
// by one (cpu_ops.h), in the same order and with the same roundings, so its output matches
// theirs; what it removes is the Python between them: a decode step of a small model spends
// milliseconds dispatching ~300 module and op calls, as much as some of its matmuls take.
#include "llama_stack.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "moe.h"
#include "project.h"

namespace {

using kvscope::LinearWeights;
using kvscope::StackConfig;

using kvscope::traced;

// A linear through the shared projection rules (project.h), with the stack's limits.
void project(const at::Tensor& x, const LinearWeights& linear, const StackConfig& config,
             at::Tensor& out) {
  kvscope::project(x, linear, config.limits(), out);
}

void normed(const at::Tensor& hidden, const at::Tensor& weight, const StackConfig& config,
            const std::optional<at::Tensor>& residual, at::Tensor& out) {
  traced("kvscope::rms_norm", [&] {
    rms_norm(hidden, weight, config.eps, out, residual, config.model.norm_unit_offset);
  });
}

// out = a MoE layer's MLP of x, as engine/worker/models/moe.py's SparseMoeBlock computes it:
// the router's top-k, the experts over the step's tokens (moe.h), and a shared expert's
// output scaled by the sigmoid of its gate where the layer has one.
void mixture_of_experts(const at::Tensor& x, const kvscope::MoeWeights& moe,
                        const kvscope::LayerOptions& options, const StackConfig& config,
                        at::Tensor& out) {
  at::Tensor logits = at::empty({x.size(0), moe.router.out_features()}, x.options());
  project(x, moe.router, config, logits);
  auto [weights, ids] = kvscope::route_top_k(logits, options.top_k, options.normalize_top_k,
                                             options.round_weights);
  traced("kvscope::moe_experts", [&] {
    kvscope::run_experts(x, ids, weights, moe.gate_up, moe.down, options.expert_activation,
                         config.limits(), out, moe.expert_counts);
  });
  if (!moe.shared_gate) return;
  const int64_t width = moe.shared_gate_up->out_features() / 2;
  at::Tensor gate_up = at::empty({x.size(0), 2 * width}, x.options());
  project(x, *moe.shared_gate_up, config, gate_up);
  at::Tensor activated = at::empty({x.size(0), width}, x.options());
  traced("kvscope::silu_and_mul", [&] { silu_and_mul(gate_up, activated); });
  at::Tensor shared = at::empty_like(out);
  project(activated, *moe.shared_down, config, shared);
  at::Tensor gate = at::empty({x.size(0), 1}, x.options());
  project(x, *moe.shared_gate, config, gate);
  out.add_(shared.mul_(gate.sigmoid_()));
}

// A token id the embedding lookups below read a row for.
void check_row(int64_t id, int64_t rows) {
  TORCH_CHECK(id >= 0 && id < rows, "index ", id, " out of range for ", rows, " rows");
}

// Rows `ids` of a contiguous 2-D table, in its dtype: index_select's result, without a trip
// through Python and the dispatcher. That matters here because a decode step streams the
// whole model first: by then its weights have pushed the interpreter's and the dispatcher's
// code and data out of the caches, and a single op called from Python costs many times what
// it costs warm.
at::Tensor gather_rows(const at::Tensor& table, const at::Tensor& ids) {
  const int64_t count = ids.size(0), rows = table.size(0), width = table.size(1);
  const int64_t row_bytes = width * table.element_size();
  at::Tensor out = at::empty({count, width}, table.options());
  const int64_t* id = ids.data_ptr<int64_t>();
  const char* source = static_cast<const char*>(table.data_ptr());
  char* target = static_cast<char*>(out.data_ptr());
  for (int64_t i = 0; i < count; ++i) {
    check_row(id[i], rows);
    std::memcpy(target + i * row_bytes, source + id[i] * row_bytes, row_bytes);
  }
  return out;
}

// Rows `ids` of a bf16 table kept only in tiles of T outputs ([rows / T, T * width],
// LinearWeights' layout): row o is output o % T of tile column o / T, where each input pair
// (4 bytes) has a row of T pairs, one per output, tile after tile (kernels/reference.py's
// blocked_rows).
at::Tensor gather_tiled_rows(const at::Tensor& table, const at::Tensor& ids, int64_t tile) {
  const int64_t count = ids.size(0), rows = table.size(0) * tile, width = table.size(1) / tile;
  at::Tensor out = at::empty({count, width}, table.options());
  const int64_t* id = ids.data_ptr<int64_t>();
  const uint32_t* source = static_cast<const uint32_t*>(table.data_ptr());
  uint32_t* target = static_cast<uint32_t*>(out.data_ptr());
  const int64_t pairs = width / 2;
  for (int64_t i = 0; i < count; ++i) {
    check_row(id[i], rows);
    const uint32_t* column = source + id[i] / tile * tile * pairs + id[i] % tile;
    for (int64_t pair = 0; pair < pairs; ++pair) target[i * pairs + pair] = column[pair * tile];
  }
  return out;
}

// Rows `ids` of an int8 table with one fp32 scale per row (engine/worker/models/quantized.py's
// Int8Embedding), de-quantized to T as that module does: q * scale in fp32, then rounded.
template <typename T>
at::Tensor dequantized_rows(const at::Tensor& table, const at::Tensor& scales,
                            const at::Tensor& ids, at::ScalarType dtype) {
  const int64_t count = ids.size(0), rows = table.size(0), width = table.size(1);
  at::Tensor out = at::empty({count, width}, table.options().dtype(dtype));
  const int64_t* id = ids.data_ptr<int64_t>();
  T* target = kvscope::elements<T>(out);
  for (int64_t i = 0; i < count; ++i) {
    check_row(id[i], rows);
    const int8_t* row = table.data_ptr<int8_t>() + id[i] * width;
    const float scale = scales.data_ptr<float>()[id[i]];
    for (int64_t k = 0; k < width; ++k)
      kvscope::store(target[i * width + k], static_cast<float>(row[k]) * scale);
  }
  return out;
}

// Every intermediate of a layer, allocated once per call and reused by each layer in turn
// (a layer consumes its inputs before it writes these), rather than ~200 small tensors and
// views created per step. A projection may hand back a tensor of its own in place of one
// (project: oneDNN's GEMM); qkv's views are then taken anew (split_qkv).
struct Workspace {
  // query and key by head [tokens, heads, head_dim]; query_rows and key_rows the same values
  // as one row per token [tokens, heads * head_dim] (Olmo 3's norms span every head).
  at::Tensor normed, qkv, query, key, value, query_rows, key_rows, attended, projected, gate_up,
      activated;
  int64_t q_width, kv_width;

  Workspace(const at::Tensor& hidden, const StackConfig& config, int64_t intermediate_size) {
    const int64_t tokens = hidden.size(0), head_dim = config.head_dim;
    const int64_t num_heads = config.num_heads, num_kv_heads = config.num_kv_heads;
    q_width = num_heads * head_dim;
    kv_width = num_kv_heads * head_dim;
    normed = at::empty_like(hidden);
    qkv = at::empty({tokens, q_width + 2 * kv_width}, hidden.options());
    split_qkv(config);
    attended = at::empty({tokens, q_width}, hidden.options());
    projected = at::empty_like(hidden);
    gate_up = at::empty({tokens, 2 * intermediate_size}, hidden.options());
    activated = at::empty({tokens, intermediate_size}, hidden.options());
  }

  // Views cost a dispatcher call each (docs/performance-history.md, "The decoder stack's views"):
  // taken again only for a new qkv.
  void split_qkv(const StackConfig& config) {
    if (query.defined() && query.data_ptr() == qkv.data_ptr()) return;
    const int64_t tokens = qkv.size(0), head_dim = config.head_dim;
    query_rows = qkv.narrow(1, 0, q_width);
    key_rows = qkv.narrow(1, q_width, kv_width);
    query = query_rows.view({tokens, config.num_heads, head_dim});
    key = key_rows.view({tokens, config.num_kv_heads, head_dim});
    value =
        qkv.narrow(1, q_width + kv_width, kv_width).view({tokens, config.num_kv_heads, head_dim});
  }
};

// A dictionary from Python read by name, remembering the names read: a name the stack does
// not read (a renamed or new parameter or option) is an error, not silently left out.
// `owner` names what the dictionary describes in those errors ("a layer").
template <typename Value>
class NameReader {
 public:
  NameReader(const c10::Dict<std::string, Value>& named, const char* owner)
      : named_(named), owner_(owner) {}

  Value required(const std::string& name) {
    std::optional<Value> value = optional(name);
    TORCH_CHECK(value, "LlamaDecoderStack: ", owner_, " has no '", name, "'");
    return *value;
  }

  std::optional<Value> optional(const std::string& name) {
    auto found = named_.find(name);
    if (found == named_.end()) return std::nullopt;
    read_.insert(name);
    return found->value();
  }

  // Whether a linear module is there, in any form linear() reads (nothing is marked read).
  bool has_linear(const std::string& module) const {
    return named_.contains(module + ".weight") || named_.contains(module + ".tiles") ||
           named_.contains(module + ".gguf_parts");
  }

  // A linear module's weight, and its bias, scales and offsets where it has them; a GGUF
  // layer's runs (weights.0, weights.1... as its ParameterList names them) and their parts.
  LinearWeights linear(const std::string& module) {
    static_assert(std::is_same_v<Value, at::Tensor>, "linear() reads tensors");
    if (std::optional<at::Tensor> parts = optional(module + ".gguf_parts")) {
      TORCH_CHECK(parts->dim() == 2 && parts->size(1) == 3 && parts->scalar_type() == at::kLong &&
                      parts->is_contiguous() && parts->size(0) > 0,
                  "LlamaDecoderStack: ", module, ".gguf_parts is int64 [runs, 3]");
      LinearWeights linear;
      linear.bias = optional(module + ".bias");
      linear.gguf_parts = parts;
      for (int64_t r = 0; r < parts->size(0); ++r)
        linear.gguf_weights.push_back(required(module + ".weights." + std::to_string(r)));
      return linear;
    }
    // A prepacked weight comes as "<module>.tiles" (decoder_stack.py's stack_tensors).
    std::optional<at::Tensor> tiles = optional(module + ".tiles");
    LinearWeights linear{tiles ? *tiles : required(module + ".weight"), optional(module + ".bias"),
                         optional(module + ".scales"), optional(module + ".offsets"),
                         optional(module + ".onednn")};
    if (tiles)
      linear.tile = linear.onednn ? LinearWeights::kAmxTileOutputs : LinearWeights::kOwnTileOutputs;
    return linear;
  }

  // One projection of every expert (a MoE layer's stacked rows, moe.py's ExpertsLinear): its
  // tensors viewed per expert, [experts, rows per expert, ...].
  kvscope::ExpertLinears experts(const std::string& module, int64_t count) {
    static_assert(std::is_same_v<Value, at::Tensor>, "experts() reads tensors");
    if (named_.contains(module + ".gguf_parts"))
      return kvscope::ExpertLinears::from_gguf(linear(module), count);
    auto per_expert = [count](const at::Tensor& rows) {
      TORCH_CHECK(rows.size(0) % count == 0, "LlamaDecoderStack: ", rows.size(0),
                  " expert rows for ", count, " experts");
      std::vector<int64_t> shape{count, rows.size(0) / count};
      for (int64_t d = 1; d < rows.dim(); ++d) shape.push_back(rows.size(d));
      return rows.view(shape);
    };
    auto each = [&](const std::optional<at::Tensor>& rows) -> std::optional<at::Tensor> {
      if (!rows) return std::nullopt;
      return per_expert(*rows);
    };
    return {per_expert(required(module + ".weight")), each(optional(module + ".bias")),
            each(optional(module + ".scales")), each(optional(module + ".offsets"))};
  }

  void check_all_read() const {
    std::string unread;
    for (const auto& entry : named_)
      if (read_.count(entry.key()) == 0) unread += " '" + entry.key() + "'";
    TORCH_CHECK(unread.empty(), "LlamaDecoderStack: ", owner_,
                " has names it does not know:", unread,
                " (DecoderLayerWeights::from, LayerOptions::from and ModelOptions::from list the "
                "names they read)");
  }

 private:
  const c10::Dict<std::string, Value>& named_;
  const char* owner_;
  std::set<std::string> read_;
};

}  // namespace

kvscope::DecoderLayerWeights kvscope::DecoderLayerWeights::from(const NamedTensors& named) {
  NameReader<at::Tensor> reader(named, "a layer");
  DecoderLayerWeights layer;
  layer.qkv_proj = reader.linear("self_attn.qkv_proj");
  layer.o_proj = reader.linear("self_attn.o_proj");
  layer.q_norm = reader.optional("self_attn.q_norm.weight");
  layer.k_norm = reader.optional("self_attn.k_norm.weight");
  TORCH_CHECK(layer.q_norm.has_value() == layer.k_norm.has_value(),
              "LlamaDecoderStack: a layer has a q_norm without a k_norm, or the reverse");
  layer.sinks = reader.optional("self_attn.sinks");
  // A Gemma layer, which names its MLP's input norm pre_feedforward_layernorm, uses the name
  // post_attention_layernorm for its attention's output norm; so does an Olmo 3 layer, which
  // has a post_feedforward_layernorm but no input norms.
  std::optional<at::Tensor> pre_mlp = reader.optional("pre_feedforward_layernorm.weight");
  std::optional<at::Tensor> post_mlp = reader.optional("post_feedforward_layernorm.weight");
  if (pre_mlp || post_mlp) {
    layer.mlp_input_norm = pre_mlp;
    layer.attention_output_norm = reader.required("post_attention_layernorm.weight");
    layer.mlp_output_norm = post_mlp;
    TORCH_CHECK(post_mlp, "LlamaDecoderStack: a layer has no 'post_feedforward_layernorm.weight'");
  } else {
    layer.mlp_input_norm = reader.required("post_attention_layernorm.weight");
  }
  // Post-norm layers only (Olmo 3) leave both input norms out.
  if (layer.mlp_input_norm) layer.input_layernorm = reader.required("input_layernorm.weight");
  if (reader.optional("mlp.gate.weight")) {
    kvscope::MoeWeights moe;
    moe.router = reader.linear("mlp.gate");
    const int64_t experts = moe.router.weight.size(0);
    moe.gate_up = reader.experts("mlp.experts.gate_up_proj", experts);
    moe.down = reader.experts("mlp.experts.down_proj", experts);
    moe.expert_counts = reader.optional("mlp.experts.token_counts");
    if (reader.has_linear("mlp.shared_expert_gate")) {
      moe.shared_gate = reader.linear("mlp.shared_expert_gate");
      moe.shared_gate_up = reader.linear("mlp.shared_expert.gate_up_proj");
      moe.shared_down = reader.linear("mlp.shared_expert.down_proj");
    }
    layer.moe = std::move(moe);
  } else {
    layer.gate_up_proj = reader.linear("mlp.gate_up_proj");
    layer.down_proj = reader.linear("mlp.down_proj");
  }
  reader.check_all_read();
  return layer;
}

kvscope::LayerOptions kvscope::LayerOptions::from(const c10::Dict<std::string, int64_t>& named) {
  NameReader<int64_t> reader(named, "a layer");
  LayerOptions options;
  options.rotary = reader.optional("rotary").value_or(1) != 0;
  options.rotary_table = reader.optional("rotary_table").value_or(0);
  options.sliding_window = reader.optional("sliding_window").value_or(0);
  TORCH_CHECK(options.sliding_window >= 0, "LlamaDecoderStack: sliding_window must be >= 0");
  options.kv_group = reader.optional("kv_group").value_or(0);
  TORCH_CHECK(options.kv_group >= 0, "LlamaDecoderStack: kv_group must be >= 0");
  options.top_k = reader.optional("top_k").value_or(0);
  options.normalize_top_k = reader.optional("normalize_top_k").value_or(0) != 0;
  const int64_t activation = reader.optional("expert_activation").value_or(0);
  TORCH_CHECK(activation == 0 || activation == 1,
              "LlamaDecoderStack: expert_activation must be 0 (silu) or 1 (swigluoai)");
  options.expert_activation = static_cast<ExpertActivation>(activation);
  options.round_weights = reader.optional("round_weights").value_or(0) != 0;
  TORCH_CHECK(options.top_k >= 0, "LlamaDecoderStack: top_k must be >= 0");
  reader.check_all_read();
  return options;
}

kvscope::ModelOptions kvscope::ModelOptions::from(const c10::Dict<std::string, double>& named) {
  NameReader<double> reader(named, "the model options");
  ModelOptions options;
  options.embedding_scale = reader.optional("embedding_scale").value_or(0.);
  options.norm_unit_offset = reader.optional("norm_unit_offset").value_or(0.) != 0.;
  options.gelu_tanh = reader.optional("gelu_tanh").value_or(0.) != 0.;
  options.attention_soft_cap = reader.optional("attention_soft_cap").value_or(0.);
  options.final_soft_cap = reader.optional("final_soft_cap").value_or(0.);
  options.embedding_gguf_type =
      static_cast<int64_t>(reader.optional("embedding_gguf_type").value_or(-1.));
  options.head_gguf_type = static_cast<int64_t>(reader.optional("head_gguf_type").value_or(-1.));
  options.embedding_tile = static_cast<int64_t>(reader.optional("embedding_tile").value_or(0.));
  options.head_tile = static_cast<int64_t>(reader.optional("head_tile").value_or(0.));
  TORCH_CHECK(options.embedding_scale >= 0. && options.attention_soft_cap >= 0. &&
                  options.final_soft_cap >= 0.,
              "LlamaDecoderStack: embedding_scale and the soft caps must be >= 0");
  for (const int64_t tile : {options.embedding_tile, options.head_tile})
    TORCH_CHECK(tile == 0 || tile == LinearWeights::kAmxTileOutputs ||
                    tile == LinearWeights::kOwnTileOutputs,
                "LlamaDecoderStack: embedding_tile and head_tile must be 0, 32 or 64");
  reader.check_all_read();
  return options;
}

LlamaDecoderStack::LlamaDecoderStack(
    at::Tensor embedding, std::optional<at::Tensor> embedding_scales, at::Tensor head,
    std::optional<at::Tensor> head_scales, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
    std::optional<at::Tensor> query_scale, at::Tensor final_norm,
    const c10::List<kvscope::NamedTensors>& layers,
    const c10::List<c10::Dict<std::string, int64_t>>& layer_options,
    const c10::Dict<std::string, double>& model_options, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t group_size, int64_t kernel_max_rows, double eps,
    double attention_scale)
    : embedding_(std::move(embedding)),
      embedding_scales_(std::move(embedding_scales)),
      head_{std::move(head), std::nullopt, std::move(head_scales), std::nullopt},
      cos_(std::move(cos)),
      sin_(std::move(sin)),
      query_scale_(std::move(query_scale)),
      final_norm_(std::move(final_norm)),
      config_{num_heads,       num_kv_heads,
              head_dim,        group_size,
              kernel_max_rows, eps,
              attention_scale, kvscope::ModelOptions::from(model_options)} {
  if (const int64_t type = config_.model.head_gguf_type; type >= 0) {
    head_.gguf_parts = at::empty({1, 3}, at::kLong);
    int64_t* part = head_.gguf_parts->data_ptr<int64_t>();
    part[0] = type;  // one run of the file's blocks: every output row
    part[1] = 0;
    part[2] = head_.weight.size(0);
    head_.gguf_weights = {head_.weight};
  }
  head_.tile = config_.model.head_tile;
  TORCH_CHECK(!cos_.empty() && cos_.size() == sin_.size(),
              "LlamaDecoderStack: one or more rotary tables, a sin table per cos table");
  std::vector<const at::Tensor*> tables = {&embedding_};
  for (size_t i = 0; i < cos_.size(); ++i) tables.insert(tables.end(), {&cos_[i], &sin_[i]});
  if (query_scale_) tables.push_back(&*query_scale_);
  for (const at::Tensor* table : tables)
    TORCH_CHECK(table->dim() == 2 && table->is_contiguous(),
                "LlamaDecoderStack: the embedding, rotary and query scale tables are contiguous "
                "[rows, width]");
  TORCH_CHECK(!query_scale_ ||
                  (query_scale_->scalar_type() == at::kFloat && query_scale_->size(1) == 1),
              "LlamaDecoderStack: query_scale is fp32 [positions, 1]");
  TORCH_CHECK((config_.model.embedding_gguf_type >= 0) == (embedding_.scalar_type() == at::kByte),
              "LlamaDecoderStack: an embedding of GGUF blocks is uint8 rows, with its type");
  TORCH_CHECK(!embedding_scales_ || (embedding_.scalar_type() == at::kChar &&
                                     embedding_scales_->scalar_type() == at::kFloat &&
                                     embedding_scales_->is_contiguous()),
              "LlamaDecoderStack: a packed embedding is int8 with fp32 scales");
  TORCH_CHECK(!layers.empty(), "LlamaDecoderStack: layers holds no decoder layer");
  TORCH_CHECK(layer_options.size() == layers.size(),
              "LlamaDecoderStack: one layer_options entry per layer (", layers.size(), ")");
  for (const kvscope::NamedTensors& named : layers)
    layers_.push_back(kvscope::DecoderLayerWeights::from(named));
  for (const c10::Dict<std::string, int64_t>& named : layer_options) {
    options_.push_back(kvscope::LayerOptions::from(named));
    TORCH_CHECK(options_.back().rotary_table < static_cast<int64_t>(cos_.size()),
                "LlamaDecoderStack: rotary_table ", options_.back().rotary_table, " but ",
                cos_.size(), " rotary tables");
  }
}

at::Tensor LlamaDecoderStack::forward(const at::Tensor& input_ids, const at::Tensor& positions,
                                      const std::vector<at::Tensor>& key_caches,
                                      const std::vector<at::Tensor>& value_caches,
                                      const at::Tensor& slot_mapping,
                                      const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                      const at::Tensor& query_start_loc) const {
  TORCH_CHECK(key_caches.size() == layers_.size() && value_caches.size() == layers_.size(),
              "LlamaDecoderStack.forward: one K and one V cache per layer (", layers_.size(),
              " layers)");
  TORCH_CHECK(input_ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  input_ids.is_contiguous() && positions.is_contiguous(),
              "LlamaDecoderStack.forward: contiguous int64 input_ids and positions");
  TORCH_CHECK(slot_mapping.dim() == 2 && block_tables.dim() == 3 &&
                  slot_mapping.size(0) == block_tables.size(0),
              "LlamaDecoderStack.forward: slot_mapping [groups, tokens] and block_tables "
              "[groups, seqs, blocks]");
  for (const kvscope::LayerOptions& options : options_)
    TORCH_CHECK(options.kv_group < block_tables.size(0), "LlamaDecoderStack.forward: kv_group ",
                options.kv_group, " but ", block_tables.size(0), " KV cache groups");
  at::Tensor hidden = embed(input_ids);
  std::vector<at::Tensor> cos, sin;
  for (size_t table = 0; table < cos_.size(); ++table) {
    cos.push_back(gather_rows(cos_[table], positions));
    sin.push_back(gather_rows(sin_[table], positions));
  }
  const int64_t tokens = hidden.size(0);
  // Each token's query scale in the model's dtype, as transformers multiplies the queries.
  std::optional<at::Tensor> query_scale;
  if (query_scale_)
    query_scale =
        gather_rows(*query_scale_, positions).to(hidden.scalar_type()).view({tokens, 1, 1});
  int64_t intermediate_size = 0;  // the dense MLPs' (a MoE layer sizes its own)
  for (const kvscope::DecoderLayerWeights& layer : layers_)
    if (!layer.moe)
      intermediate_size = std::max(intermediate_size, layer.gate_up_proj.out_features() / 2);
  Workspace work(hidden, config_, intermediate_size);
  const at::Tensor attended = work.attended.view({tokens, config_.num_heads, config_.head_dim});
  const at::Tensor& residual = hidden;
  // Each KV cache group's rows, selected once rather than by every layer of the group.
  std::vector<at::Tensor> group_slots, group_tables;
  for (int64_t group = 0; group < block_tables.size(0); ++group) {
    group_slots.push_back(slot_mapping[group]);
    group_tables.push_back(block_tables[group]);
  }
  for (size_t index = 0; index < layers_.size(); ++index) {
    const kvscope::DecoderLayerWeights& layer = layers_[index];
    // The first layer's norm reads the embeddings; later ones first add the previous
    // layer's output into the residual stream.
    const bool first = index == 0;
    const int64_t group = options_[index].kv_group;
    const kvscope::LayerOptions& options = options_[index];
    if (layer.input_layernorm) {
      normed(first ? hidden : work.projected, *layer.input_layernorm, config_,
             first ? std::nullopt : std::optional<at::Tensor>(residual), work.normed);
      project(work.normed, layer.qkv_proj, config_, work.qkv);
    } else {  // a post-norm layer's attention reads the residual stream itself
      if (!first) traced("aten::add_", [&] { residual.add_(work.projected); });
      project(residual, layer.qkv_proj, config_, work.qkv);
    }
    work.split_qkv(config_);
    if (layer.q_norm) {  // queries and keys normalised in place, before the rotary
      const bool per_head = layer.q_norm->numel() == config_.head_dim;
      at::Tensor query = per_head ? work.query : work.query_rows;
      at::Tensor key = per_head ? work.key : work.key_rows;
      normed(query, *layer.q_norm, config_, std::nullopt, query);
      normed(key, *layer.k_norm, config_, std::nullopt, key);
    }
    if (options.rotary)
      traced("kvscope::rotary_embedding", [&] {
        rotary_embedding(work.qkv, cos[options.rotary_table], sin[options.rotary_table],
                         config_.num_heads + config_.num_kv_heads, config_.head_dim);
      });
    if (query_scale) traced("aten::mul_", [&] { work.query.mul_(*query_scale); });
    traced("kvscope::store_kv", [&] {
      store_kv(work.key, work.value, key_caches[index], value_caches[index], group_slots[group]);
    });
    traced("kvscope::paged_attention", [&] {
      paged_attention(work.query, key_caches[index], value_caches[index], group_tables[group],
                      seq_lens, query_start_loc, config_.attention_scale, attended,
                      options.sliding_window, config_.model.attention_soft_cap, layer.sinks);
    });
    project(work.attended, layer.o_proj, config_, work.projected);
    if (layer.attention_output_norm)
      normed(work.projected, *layer.attention_output_norm, config_, std::nullopt, work.projected);
    // A post-norm layer's MLP (Olmo 3) reads the residual stream itself.
    if (layer.mlp_input_norm)
      normed(work.projected, *layer.mlp_input_norm, config_, residual, work.normed);
    else
      traced("aten::add_", [&] { residual.add_(work.projected); });
    const at::Tensor& mlp_input = layer.mlp_input_norm ? work.normed : residual;
    if (layer.moe) {
      mixture_of_experts(mlp_input, *layer.moe, options, config_, work.projected);
    } else {
      project(mlp_input, layer.gate_up_proj, config_, work.gate_up);
      if (config_.model.gelu_tanh)
        traced("kvscope::gelu_tanh_and_mul",
               [&] { gelu_tanh_and_mul(work.gate_up, work.activated); });
      else
        traced("kvscope::silu_and_mul", [&] { silu_and_mul(work.gate_up, work.activated); });
      project(work.activated, layer.down_proj, config_, work.projected);
    }
    if (layer.mlp_output_norm)
      normed(work.projected, *layer.mlp_output_norm, config_, std::nullopt, work.projected);
  }
  at::Tensor out = at::empty_like(hidden);
  normed(work.projected, final_norm_, config_, residual, out);
  return out;
}

at::Tensor LlamaDecoderStack::logits(const at::Tensor& hidden) const {
  const at::Tensor x = hidden.stride(-1) == 1 ? hidden : hidden.contiguous();
  at::Tensor out = at::empty({x.size(0), head_.out_features()}, x.options().dtype(at::kFloat));
  project(x, head_, config_, out);
  if (const double cap = config_.model.final_soft_cap; cap > 0.) out.div_(cap).tanh_().mul_(cap);
  return out;
}

// The embeddings of `ids` in the model's dtype (the final norm's), as the embedding module
// computes them, then scaled where the model scales them.
at::Tensor LlamaDecoderStack::embed(const at::Tensor& ids) const {
  at::Tensor rows;
  if (const int64_t type = config_.model.embedding_gguf_type; type >= 0) {
    // As GgufEmbedding: the chosen rows' blocks, de-quantized into the model's dtype.
    const at::Tensor blocks = gather_rows(embedding_, ids);
    rows = at::empty({ids.size(0), final_norm_.size(0)},
                     blocks.options().dtype(final_norm_.scalar_type()));
    traced("kvscope::gguf_dequantize", [&] { gguf_dequantize(blocks, type, rows); });
  } else if (const int64_t tile = config_.model.embedding_tile; tile > 0) {
    rows = gather_tiled_rows(embedding_, ids, tile);
  } else if (!embedding_scales_) {
    rows = gather_rows(embedding_, ids);
  } else {
    const at::ScalarType dtype = final_norm_.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
                "LlamaDecoderStack: int8 embeddings de-quantize to float32 or bfloat16");
    rows = dtype == at::kFloat
               ? dequantized_rows<float>(embedding_, *embedding_scales_, ids, dtype)
               : dequantized_rows<kvscope::bf16>(embedding_, *embedding_scales_, ids, dtype);
  }
  // The scale in the rows' dtype, as a tensor of it multiplies them from Python (Gemma).
  if (config_.model.embedding_scale > 0.)
    rows.mul_(at::scalar_tensor(config_.model.embedding_scale, rows.options()));
  return rows;
}
