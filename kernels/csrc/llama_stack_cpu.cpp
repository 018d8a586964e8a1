// A Llama-family decoder stack (the token embedding and rotary lookups, every layer, then the
// final norm) as one call on the CPU, and the output projection (the logits) as another.
// It chains the same C++ ops the Python layers call one by one (cpu_ops.h), in the same
// order and with the same roundings, so its output matches theirs; what it removes is the
// Python between them: a decode step of a small model spends milliseconds dispatching
// ~300 module and op calls, as much as some of its matmuls take.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_ops.h"

#include <cstring>
#include <optional>
#include <vector>

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

// out = x @ weight.T (+ bias) through oneDNN's GEMM, in x's dtype; an fp32 out of bf16 x (the
// logits) holds that result widened, as `.float()` of it from Python would.
void gemm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
          at::Tensor& out) {
  if (out.scalar_type() == x.scalar_type())
    at::linear_out(out, x, weight, bias);
  else
    out.copy_(at::linear(x, weight, bias));
}

// out = x @ weight.T (+ bias) for packed weights: up to kernel_max_rows rows stream the packed
// weight through a kernel; more rows are compute-bound and de-quantize once for a GEMM.
void quantized_project(const at::Tensor& x, const LinearWeights& linear, at::Tensor& out) {
  const bool int4 = linear.weight.scalar_type() == at::kByte;
  if (x.size(0) <= linear.kernel_max_rows) {
    if (int4)
      traced("kvscope::int4_linear", [&] {
        int4_linear(x, linear.weight, *linear.scales, *linear.offsets, linear.group_size,
                    linear.bias, out);
      });
    else
      traced("kvscope::int8_linear",
             [&] { int8_linear(x, linear.weight, *linear.scales, linear.bias, out); });
    return;
  }
  at::Tensor dense = at::empty({linear.weight.size(0), x.size(1)}, x.options());
  if (int4)
    traced("kvscope::int4_dequantize", [&] {
      int4_dequantize(linear.weight, *linear.scales, *linear.offsets, linear.group_size, dense);
    });
  else
    traced("kvscope::int8_dequantize",
           [&] { int8_dequantize(linear.weight, *linear.scales, dense); });
  gemm(x, dense, linear.bias, out);
}

// out = x @ weight.T (+ bias), in x's dtype or (the logits) fp32. Dense weights: one row
// streams its weights through the dot-product kernel, more rows go to oneDNN's GEMM (as
// kernels/forward_ops.py's linear does); packed ones as their modules do.
void project(const at::Tensor& x, const LinearWeights& linear, at::Tensor& out) {
  if (linear.scales) return quantized_project(x, linear, out);
  if (x.size(0) != 1) return gemm(x, linear.weight, linear.bias, out);
  traced("kvscope::linear_small_batch",
         [&] { linear_small_batch(x, linear.weight, linear.bias, out); });
}

void normed(const at::Tensor& hidden, const at::Tensor& weight, double eps,
            const std::optional<at::Tensor>& residual, at::Tensor& out) {
  traced("kvscope::rms_norm", [&] { rms_norm(hidden, weight, eps, out, residual); });
}

// Rows `ids` of a contiguous 2-D table, in its dtype: index_select's result, without a trip
// through Python and the dispatcher. That matters here because a decode step streams the
// whole model first: by then its weights have pushed the interpreter's and the dispatcher's
// code and data out of the caches, and a single op called from Python took ~40-55 us where
// it takes ~3 us warm (a ~5-op embedding lookup ~70-80 us per token, either dtype).
at::Tensor gather_rows(const at::Tensor& table, const at::Tensor& ids) {
  const int64_t count = ids.size(0), rows = table.size(0), width = table.size(1);
  const int64_t row_bytes = width * table.element_size();
  at::Tensor out = at::empty({count, width}, table.options());
  const int64_t* id = ids.data_ptr<int64_t>();
  const char* source = static_cast<const char*>(table.data_ptr());
  char* target = static_cast<char*>(out.data_ptr());
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < rows, "index ", id[i], " out of range for ", rows, " rows");
    std::memcpy(target + i * row_bytes, source + id[i] * row_bytes, row_bytes);
  }
  return out;
}

// Rows `ids` of an int8 table with one fp32 scale per row (engine/models/quantized.py's
// Int8Embedding), de-quantized to T as that module does: q * scale in fp32, then rounded.
template <typename T>
at::Tensor dequantized_rows(const at::Tensor& table, const at::Tensor& scales,
                            const at::Tensor& ids, at::ScalarType dtype) {
  const int64_t count = ids.size(0), rows = table.size(0), width = table.size(1);
  at::Tensor out = at::empty({count, width}, table.options().dtype(dtype));
  const int64_t* id = ids.data_ptr<int64_t>();
  T* target = kvscope::elements<T>(out);
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < rows, "index ", id[i], " out of range for ", rows, " rows");
    const int8_t* row = table.data_ptr<int8_t>() + id[i] * width;
    const float scale = scales.data_ptr<float>()[id[i]];
    for (int64_t k = 0; k < width; ++k)
      kvscope::store(target[i * width + k], static_cast<float>(row[k]) * scale);
  }
  return out;
}

// Every intermediate of a layer, allocated once per call and reused by each layer in turn
// (a layer consumes its inputs before it writes these). Creating ~200 small tensors and views
// per step instead cost a one-token decode ~0.4 ms, twice its norms.
struct Workspace {
  at::Tensor normed, qkv, query, key, value, attended, projected, gate_up, activated;

  Workspace(const at::Tensor& hidden, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_dim, int64_t intermediate_size) {
    const int64_t tokens = hidden.size(0);
    const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
    normed = at::empty_like(hidden);
    qkv = at::empty({tokens, q_width + 2 * kv_width}, hidden.options());
    query = qkv.narrow(1, 0, q_width).view({tokens, num_heads, head_dim});
    key = qkv.narrow(1, q_width, kv_width).view({tokens, num_kv_heads, head_dim});
    value = qkv.narrow(1, q_width + kv_width, kv_width).view({tokens, num_kv_heads, head_dim});
    attended = at::empty({tokens, q_width}, hidden.options());
    projected = at::empty_like(hidden);
    gate_up = at::empty({tokens, 2 * intermediate_size}, hidden.options());
    activated = at::empty({tokens, intermediate_size}, hidden.options());
  }
};

}  // namespace

// A model's decoder layers bound once (kvscope.LlamaDecoderStack): the weights cross from
// Python when the model is loaded; a step passes only its own inputs (converting ~500
// weights and Nones to call arguments cost every step ~40 us).
class LlamaDecoderStack : public torch::CustomClassHolder {
 public:
  // embedding: the token embedding table, dense or int8 with embedding_scales (one per row);
  // head, head_scales: the output projection alike (the embedding's own when they are tied);
  // cos, sin: the rotary tables, a row per position. weights: kWeightsPerLayer per layer;
  // biases, scales and offsets: kLinearsPerLayer per layer (None where a projection has
  // none; scales only for packed weights, offsets only for int4). shape: num_heads,
  // num_kv_heads, head_dim.
  LlamaDecoderStack(at::Tensor embedding, std::optional<at::Tensor> embedding_scales,
                    at::Tensor head, std::optional<at::Tensor> head_scales,
                    at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> weights,
                    c10::List<std::optional<at::Tensor>> biases,
                    c10::List<std::optional<at::Tensor>> scales,
                    c10::List<std::optional<at::Tensor>> offsets, int64_t group_size,
                    int64_t kernel_max_rows, at::Tensor final_norm, std::vector<int64_t> shape,
                    double eps, double scale)
      : embedding_(std::move(embedding)), embedding_scales_(std::move(embedding_scales)),
        head_(std::move(head)), head_scales_(std::move(head_scales)), cos_(std::move(cos)),
        sin_(std::move(sin)), weights_(std::move(weights)),
        group_size_(group_size), kernel_max_rows_(kernel_max_rows),
        final_norm_(std::move(final_norm)), eps_(eps), scale_(scale) {
    for (const at::Tensor* table : {&embedding_, &cos_, &sin_})
      TORCH_CHECK(table->dim() == 2 && table->is_contiguous(),
                  "LlamaDecoderStack: the embedding and rotary tables are contiguous [rows, width]");
    TORCH_CHECK(!embedding_scales_ || (embedding_.scalar_type() == at::kChar &&
                                       embedding_scales_->scalar_type() == at::kFloat &&
                                       embedding_scales_->is_contiguous()),
                "LlamaDecoderStack: a packed embedding is int8 with fp32 scales");
    const int64_t linears = static_cast<int64_t>(weights_.size()) / kWeightsPerLayer * kLinearsPerLayer;
    TORCH_CHECK(static_cast<int64_t>(weights_.size()) % kWeightsPerLayer == 0 &&
                static_cast<int64_t>(biases.size()) == linears &&
                static_cast<int64_t>(scales.size()) == linears &&
                static_cast<int64_t>(offsets.size()) == linears && shape.size() == 3,
                "LlamaDecoderStack: ", kWeightsPerLayer, " weights and ", kLinearsPerLayer,
                " biases, scales and offsets per layer, and [heads, kv_heads, head_dim]");
    for (int64_t i = 0; i < linears; ++i) {
      biases_.push_back(biases.get(i));
      scales_.push_back(scales.get(i));
      offsets_.push_back(offsets.get(i));
    }
    num_heads_ = shape[0];
    num_kv_heads_ = shape[1];
    head_dim_ = shape[2];
  }

  // input_ids, positions: int64 [tokens]; one K and one V cache per layer. The embeddings
  // become the residual stream (updated in place). Returns the final norm's output.
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions,
                     const std::vector<at::Tensor>& key_caches,
                     const std::vector<at::Tensor>& value_caches, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc) const {
    const int64_t layers = static_cast<int64_t>(weights_.size()) / kWeightsPerLayer;
    TORCH_CHECK(static_cast<int64_t>(key_caches.size()) == layers &&
                static_cast<int64_t>(value_caches.size()) == layers,
                "LlamaDecoderStack.forward: one K and one V cache per layer");
    TORCH_CHECK(input_ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                input_ids.is_contiguous() && positions.is_contiguous(),
                "LlamaDecoderStack.forward: contiguous int64 input_ids and positions");
    at::Tensor hidden = embed(input_ids);
    const at::Tensor cos = gather_rows(cos_, positions), sin = gather_rows(sin_, positions);
    const int64_t tokens = hidden.size(0);
    const int64_t intermediate_size = weights_[kLinearWeight[2]].size(0) / 2;  // gate_up's rows
    Workspace work(hidden, num_heads_, num_kv_heads_, head_dim_, intermediate_size);
    const at::Tensor attended = work.attended.view({tokens, num_heads_, head_dim_});
    const at::Tensor& residual = hidden;
    for (int64_t layer = 0; layer < layers; ++layer) {
      const at::Tensor* w = weights_.data() + layer * kWeightsPerLayer;
      auto linear = [&](int64_t index) {
        const int64_t at = layer * kLinearsPerLayer + index;
        return LinearWeights{w[kLinearWeight[index]], biases_[at], scales_[at], offsets_[at],
                             group_size_, kernel_max_rows_};
      };
      // The first layer's norm reads the embeddings; later ones first add the previous
      // layer's output into the residual stream.
      normed(layer == 0 ? hidden : work.projected, w[0], eps_,
             layer == 0 ? std::nullopt : std::optional<at::Tensor>(residual), work.normed);
      project(work.normed, linear(0), work.qkv);
      traced("kvscope::rotary_embedding", [&] {
        rotary_embedding(work.qkv, cos, sin, num_heads_ + num_kv_heads_, head_dim_);
      });
      traced("kvscope::store_kv", [&] {
        store_kv(work.key, work.value, key_caches[layer], value_caches[layer], slot_mapping);
      });
      traced("kvscope::paged_attention", [&] {
        paged_attention(work.query, key_caches[layer], value_caches[layer], block_tables,
                        seq_lens, query_start_loc, scale_, attended);
      });
      project(work.attended, linear(1), work.projected);
      normed(work.projected, w[3], eps_, residual, work.normed);
      project(work.normed, linear(2), work.gate_up);
      traced("kvscope::silu_and_mul", [&] { silu_and_mul(work.gate_up, work.activated); });
      project(work.activated, linear(3), work.projected);
    }
    at::Tensor out = at::empty_like(hidden);
    normed(work.projected, final_norm_, eps_, residual, out);
    return out;
  }

  // hidden @ head.T in fp32 [rows, vocab], each value rounded to hidden's dtype first, as
  // engine/models/quantized.output_logits computes it from Python (project's paths, with an
  // fp32 out). Called right after the stack, when the Python and ops around the head cost
  // ~50 us a token.
  at::Tensor logits(const at::Tensor& hidden) const {
    const at::Tensor x = hidden.stride(-1) == 1 ? hidden : hidden.contiguous();
    at::Tensor out = at::empty({x.size(0), head_.size(0)}, x.options().dtype(at::kFloat));
    project(x, LinearWeights{head_, std::nullopt, head_scales_, std::nullopt, 0, kernel_max_rows_},
            out);
    return out;
  }

 private:
  // The embeddings of `ids` in the model's dtype (the final norm's), as the embedding module
  // computes them.
  at::Tensor embed(const at::Tensor& ids) const {
    if (!embedding_scales_) return gather_rows(embedding_, ids);
    const at::ScalarType dtype = final_norm_.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
                "LlamaDecoderStack: int8 embeddings de-quantize to float32 or bfloat16");
    return dtype == at::kFloat
               ? dequantized_rows<float>(embedding_, *embedding_scales_, ids, dtype)
               : dequantized_rows<kvscope::bf16>(embedding_, *embedding_scales_, ids, dtype);
  }

  at::Tensor embedding_;
  std::optional<at::Tensor> embedding_scales_;
  at::Tensor head_;
  std::optional<at::Tensor> head_scales_;
  at::Tensor cos_, sin_;
  std::vector<at::Tensor> weights_;
  std::vector<std::optional<at::Tensor>> biases_, scales_, offsets_;
  int64_t group_size_, kernel_max_rows_;
  at::Tensor final_norm_;
  int64_t num_heads_ = 0, num_kv_heads_ = 0, head_dim_ = 0;
  double eps_, scale_;
};

TORCH_LIBRARY_FRAGMENT(kvscope, m) {
  m.class_<LlamaDecoderStack>("LlamaDecoderStack")
      .def(torch::init<at::Tensor, std::optional<at::Tensor>, at::Tensor,
                       std::optional<at::Tensor>, at::Tensor, at::Tensor,
                       std::vector<at::Tensor>, c10::List<std::optional<at::Tensor>>,
                       c10::List<std::optional<at::Tensor>>, c10::List<std::optional<at::Tensor>>,
                       int64_t, int64_t, at::Tensor, std::vector<int64_t>, double, double>())
      .def("forward", &LlamaDecoderStack::forward)
      .def("logits", &LlamaDecoderStack::logits);
}
