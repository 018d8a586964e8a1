// The experts of a mixture-of-experts layer (moe.h). A step's (token, expert) pairs are sorted
// by expert once (a counting sort: tokens ascending within each expert), the chosen rows
// gathered into one buffer, and each expert that has rows runs its gate/up projection, the
// activation and its down projection once over them: its weights are read once per call, and
// a decode step reads only its tokens' top-k experts. The projections are the ordinary linear
// kernels (project.h), which spread each over the work pool's threads; the gather and the
// weighted sum back per token split over tokens (work_pool.h).
#include "moe.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "work_pool.h"

kvscope::ExpertLinears kvscope::ExpertLinears::from_gguf(const LinearWeights& stacked,
                                                         int64_t experts) {
  const at::Tensor& parts = *stacked.gguf_parts;
  TORCH_CHECK(parts.dim() == 2 && parts.size(1) == 3 && parts.scalar_type() == at::kLong &&
                  parts.is_contiguous() && parts.size(0) > 0 &&
                  parts.size(0) == static_cast<int64_t>(stacked.gguf_weights.size()),
              "moe_experts: a GGUF projection's parts are int64 [runs, 3], one per run");
  const int64_t rows = stacked.out_features();
  TORCH_CHECK(experts > 0 && rows % experts == 0, "moe_experts: ", rows, " GGUF rows for ",
              experts, " experts");
  const int64_t share = rows / experts, runs = parts.size(0);
  const int64_t* part = parts.data_ptr<int64_t>();
  ExpertLinears linears;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t first = e * share, end = first + share;
    LinearWeights linear;
    std::vector<int64_t> own;  // (type, first row, end row) per run, rows from the expert's
    for (int64_t r = 0; r < runs; ++r) {
      const int64_t from = std::max(first, part[3 * r + 1]), to = std::min(end, part[3 * r + 2]);
      if (from >= to) continue;
      own.insert(own.end(), {part[3 * r], from - first, to - first});
      linear.gguf_weights.push_back(
          stacked.gguf_weights[r].narrow(0, from - part[3 * r + 1], to - from));
    }
    const int64_t own_runs = static_cast<int64_t>(own.size()) / 3;
    linear.gguf_parts = at::empty({own_runs, 3}, at::kLong);
    std::copy(own.begin(), own.end(), linear.gguf_parts->data_ptr<int64_t>());
    if (stacked.bias) linear.bias = stacked.bias->view({-1}).narrow(0, first, share);
    linears.gguf_experts.push_back(std::move(linear));
  }
  return linears;
}

kvscope::LinearWeights kvscope::ExpertLinears::expert(int64_t e) const {
  if (!gguf_experts.empty()) return gguf_experts[e];
  LinearWeights linear;
  linear.weight = weight.select(0, e);
  if (bias) linear.bias = bias->select(0, e);
  if (scales) linear.scales = scales->select(0, e);
  if (offsets) linear.offsets = offsets->select(0, e);
  return linear;
}

kvscope::ExpertActivation kvscope::expert_activation(const std::string& name) {
  if (name == "swigluoai") return ExpertActivation::kSwigluOai;
  TORCH_CHECK(name == "silu", "moe_experts: activation '", name, "'; supported: silu, swigluoai");
  return ExpertActivation::kSilu;
}

namespace {

// kernel_ops.SWIGLU_ALPHA and SWIGLU_LIMIT.
constexpr float kSwigluAlpha = 1.702f, kSwigluLimit = 7.f;

// out [rows, width] = gpt-oss's activation of x's gate half (the first) and up half: gate
// clamped to at most the limit, up to +-limit, gate * sigmoid(alpha * gate) * (up + 1),
// in fp32 and rounded once (reference.expert_activation).
template <typename T>
void swiglu_oai_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), width = out.size(1);
  const T* in = kvscope::elements<T>(x);
  T* y = kvscope::elements<T>(out);
  kvscope::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t i = 0; i < width; ++i) {
        const float gate = std::min(kvscope::load(in[r * 2 * width + i]), kSwigluLimit);
        const float up = std::clamp(kvscope::load(in[r * 2 * width + width + i]), -kSwigluLimit,
                                    kSwigluLimit);
        const float glu = gate * (1.f / (1.f + std::exp(-(gate * kSwigluAlpha))));
        kvscope::store(y[r * width + i], glu * (up + 1.f));
      }
  });
}

// The sum back per token: out[t] = sum over its k experts, ascending, of weight * that
// expert's output row (rows[position[t * k + j]]), in fp32, rounded once to T.
template <typename T>
void weighted_sums(const at::Tensor& rows, const std::vector<int64_t>& position, const int64_t* ids,
                   const float* weights, int64_t tokens, int64_t k, at::Tensor& out) {
  const int64_t width = out.size(1);
  const T* source = kvscope::elements<T>(rows);
  T* target = kvscope::elements<T>(out);
  kvscope::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(width);
    std::vector<int64_t> slots(k);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t j = 0; j < k; ++j) slots[j] = t * k + j;
      std::sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
      std::fill(sums.begin(), sums.end(), 0.f);
      for (const int64_t slot : slots) {
        const T* row = source + position[slot] * width;
        const float weight = weights[slot];
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) sums[i] += kvscope::load(row[i]) * weight;
      }
      T* y = target + t * out.stride(0);
      for (int64_t i = 0; i < width; ++i) kvscope::store(y[i], sums[i]);
    }
  });
}

}  // namespace

void kvscope::run_experts(const at::Tensor& hidden, const at::Tensor& ids,
                          const at::Tensor& weights, const ExpertLinears& gate_up,
                          const ExpertLinears& down, ExpertActivation activation,
                          const ProjectLimits& limits, at::Tensor& out,
                          const std::optional<at::Tensor>& counts) {
  const int64_t tokens = hidden.size(0), width = hidden.size(1), experts = gate_up.experts();
  TORCH_CHECK(hidden.dim() == 2 && hidden.stride(1) == 1 &&
                  (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16),
              "moe_experts: hidden is float32 or bfloat16 rows [tokens, hidden]");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == tokens && ids.scalar_type() == at::kLong &&
                  ids.is_contiguous(),
              "moe_experts: expert_ids is contiguous int64 [tokens, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat &&
                  weights.is_contiguous(),
              "moe_experts: expert_weights is contiguous float32 [tokens, k]");
  TORCH_CHECK(down.experts() == experts && gate_up.out_features() % 2 == 0,
              "moe_experts: gate_up [experts, 2 * width, hidden] and down "
              "[experts, hidden, width]");
  TORCH_CHECK(out.sizes() == hidden.sizes() && out.scalar_type() == hidden.scalar_type() &&
                  out.stride(1) == 1,
              "moe_experts: out is like hidden");
  const int64_t k = ids.size(1), pairs = tokens * k;
  const int64_t* id = ids.data_ptr<int64_t>();
  // start[e]: expert e's first row in the sorted order; position[slot]: a pair's row there.
  std::vector<int64_t> start(experts + 1, 0), position(pairs), token_of(pairs);
  for (int64_t slot = 0; slot < pairs; ++slot) {
    TORCH_CHECK(id[slot] >= 0 && id[slot] < experts, "moe_experts: expert id ", id[slot],
                " out of range for ", experts, " experts");
    ++start[id[slot] + 1];
  }
  if (counts) {
    TORCH_CHECK(counts->scalar_type() == at::kLong && counts->is_contiguous() &&
                    counts->numel() == experts,
                "moe_experts: expert_counts is contiguous int64 [experts]");
    std::copy(start.begin() + 1, start.end(), counts->data_ptr<int64_t>());
  }
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t slot = 0; slot < pairs; ++slot) {
    position[slot] = next[id[slot]]++;
    token_of[position[slot]] = slot / k;
  }
  const at::Tensor gathered = at::empty({pairs, width}, hidden.options());
  const int64_t row_bytes = width * hidden.element_size();
  const char* source = static_cast<const char*>(hidden.data_ptr());
  char* target = static_cast<char*>(gathered.data_ptr());
  kvscope::parallel_for(0, pairs, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      std::memcpy(target + row * row_bytes, source + token_of[row] * hidden.stride(0) *
                  hidden.element_size(), row_bytes);
  });
  const int64_t expert_width = gate_up.out_features() / 2;
  const at::Tensor expert_rows = at::empty({pairs, width}, hidden.options());
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = start[e + 1] - start[e];
    if (rows == 0) continue;
    at::Tensor x = gathered.narrow(0, start[e], rows);
    at::Tensor projected = at::empty({rows, 2 * expert_width}, hidden.options());
    project(x, gate_up.expert(e), limits, projected);
    at::Tensor activated = at::empty({rows, expert_width}, hidden.options());
    switch (activation) {
      case ExpertActivation::kSilu:
        traced("kvscope::silu_and_mul", [&] { silu_and_mul(projected, activated); });
        break;
      case ExpertActivation::kSwigluOai:
        if (hidden.scalar_type() == at::kFloat)
          swiglu_oai_rows<float>(projected, activated);
        else
          swiglu_oai_rows<kvscope::bf16>(projected, activated);
        break;
    }
    // Experts are never in oneDNN's tiles, so project writes into this view.
    at::Tensor y = expert_rows.narrow(0, start[e], rows);
    project(activated, down.expert(e), limits, y);
  }
  const float* weight = weights.data_ptr<float>();
  if (hidden.scalar_type() == at::kFloat)
    weighted_sums<float>(expert_rows, position, id, weight, tokens, k, out);
  else
    weighted_sums<kvscope::bf16>(expert_rows, position, id, weight, tokens, k, out);
}

std::tuple<at::Tensor, at::Tensor> kvscope::route_top_k(const at::Tensor& logits, int64_t top_k,
                                                        bool normalize, bool round_weights) {
  const at::Tensor probabilities = at::softmax(logits, -1, at::kFloat);
  auto [weights, ids] = at::topk(probabilities, top_k, -1);
  if (normalize) weights.div_(weights.sum(-1, true));
  if (round_weights) weights = weights.to(logits.scalar_type()).to(at::kFloat);
  return {weights.contiguous(), ids.contiguous()};
}

void moe_experts(const at::Tensor& hidden, const at::Tensor& expert_ids,
                 const at::Tensor& expert_weights, const at::Tensor& gate_up,
                 const std::optional<at::Tensor>& gate_up_bias,
                 const std::optional<at::Tensor>& gate_up_scales,
                 const std::optional<at::Tensor>& gate_up_offsets, const at::Tensor& down,
                 const std::optional<at::Tensor>& down_bias,
                 const std::optional<at::Tensor>& down_scales,
                 const std::optional<at::Tensor>& down_offsets, int64_t group_size,
                 int64_t kernel_max_rows, const std::string& activation, at::Tensor out,
                 const std::optional<at::Tensor>& expert_counts, int64_t num_experts,
                 const std::vector<at::Tensor>& gate_up_gguf,
                 const std::vector<at::Tensor>& down_gguf) {
  // A GGUF projection comes as its runs (*_gguf), its weight their parts [runs, 3] over every
  // expert's rows (kernel_ops.ExpertWeights).
  auto linears = [num_experts](const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& scales,
                               const std::optional<at::Tensor>& offsets,
                               const std::vector<at::Tensor>& gguf) -> kvscope::ExpertLinears {
    if (gguf.empty()) return {weight, bias, scales, offsets};
    kvscope::LinearWeights stacked;
    stacked.gguf_parts = weight;
    stacked.gguf_weights = gguf;
    stacked.bias = bias;
    return kvscope::ExpertLinears::from_gguf(stacked, num_experts);
  };
  kvscope::run_experts(hidden, expert_ids, expert_weights,
                       linears(gate_up, gate_up_bias, gate_up_scales, gate_up_offsets, gate_up_gguf),
                       linears(down, down_bias, down_scales, down_offsets, down_gguf),
                       kvscope::expert_activation(activation), {group_size, kernel_max_rows},
                       out, expert_counts);
}
