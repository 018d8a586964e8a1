// A mixture-of-experts layer's experts over a step's tokens (moe.cpp): the tokens grouped by
// expert, each chosen expert's projections run once over its group through the same linear
// kernels every other layer uses (project.h), the results summed back per token with the
// router's weights. torch.ops.kvscope.moe_experts from Python; the decoder stack calls
// run_experts (and route_top_k) per MoE layer.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "project.h"

namespace kvscope {

// One projection of every expert, stacked along a first dimension of experts, as
// kernels/kernel_ops.py's ExpertWeights describes: dense [experts, out, in], int4 (uint8
// [experts, out, in / 2] with float16 scales and offsets [experts, out, groups]) or int8
// (int8 [experts, out, in] with fp32 scales [experts, out]); bias [experts, out]. A GGUF
// projection (one GGUF layer over every expert's rows) is held as each expert's own GGUF
// layer instead (from_gguf), and `weight` is unused.
struct ExpertLinears {
  at::Tensor weight;
  std::optional<at::Tensor> bias, scales, offsets;
  std::vector<LinearWeights> gguf_experts;

  // `stacked`'s rows (a GGUF layer: gguf_parts and gguf_weights, and its bias) as `experts`
  // equal shares, each expert's runs views of the stacked runs it spans.
  static ExpertLinears from_gguf(const LinearWeights& stacked, int64_t experts);

  int64_t experts() const {
    return gguf_experts.empty() ? weight.size(0) : static_cast<int64_t>(gguf_experts.size());
  }
  int64_t out_features() const {
    return gguf_experts.empty() ? weight.size(1) : gguf_experts.front().out_features();
  }
  // Expert e's weights as one linear (views of its rows).
  LinearWeights expert(int64_t e) const;
};

// The activations between the gate/up and the down projections (kernel_ops.EXPERT_ACTIVATIONS).
// kSwigluOai: gpt-oss's clamped SwiGLU (kernel_ops.SWIGLU_ALPHA / SWIGLU_LIMIT).
enum class ExpertActivation { kSilu, kSwigluOai };
ExpertActivation expert_activation(const std::string& name);

// out [tokens, hidden] in hidden's dtype: for each token, the sum over its k experts
// (ids int64 [tokens, k]) of weights[token, j] (fp32 [tokens, k]) times
// down(act(gate_up(row))), summed in fp32 in ascending expert order and rounded once.
// counts (int64 [experts], or none) gets how many of the tokens each expert took.
void run_experts(const at::Tensor& hidden, const at::Tensor& ids, const at::Tensor& weights,
                 const ExpertLinears& gate_up, const ExpertLinears& down,
                 ExpertActivation activation, const ProjectLimits& limits, at::Tensor& out,
                 const std::optional<at::Tensor>& counts);

// The router's choice from its logits [tokens, experts]: the top_k of their fp32 softmax
// (weights fp32, ids int64 [tokens, top_k]), rescaled to sum to 1 where `normalize`, and
// rounded to the logits' dtype where `round_weights` (engine/worker/models/moe.py's
// TopKRouter, op for op).
std::tuple<at::Tensor, at::Tensor> route_top_k(const at::Tensor& logits, int64_t top_k,
                                               bool normalize, bool round_weights);

}  // namespace kvscope
