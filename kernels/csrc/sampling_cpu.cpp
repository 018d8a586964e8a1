// Greedy decoding's pick from fp32 logits: each row's first largest logit and its
// log-probability, in two passes over the row (the largest value and where it is; then the
// sum of exp(x - max)). torch's argmax, log_softmax and gather took ~0.2 ms of a one-token
// decode step over a 49k vocabulary: argmax is a scalar loop, and log_softmax writes the
// whole row and wakes torch's sleeping OpenMP threads for it.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "work_pool.h"

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

constexpr int kLanes = 16;

struct Pick {
  int64_t token;
  float logprob;
};

Pick greedy_row(const float* __restrict row, int64_t size) {
  // Pass 1, per lane: the largest value and the first index holding it.
  float lane_max[kLanes];
  int64_t lane_index[kLanes];
  for (int lane = 0; lane < kLanes; ++lane) {
    lane_max[lane] = -std::numeric_limits<float>::infinity();
    lane_index[lane] = size;
  }
  int64_t k = 0;
  for (; k + kLanes <= size; k += kLanes)
#pragma omp simd
    for (int lane = 0; lane < kLanes; ++lane) {
      const float value = row[k + lane];
      const bool larger = value > lane_max[lane];
      lane_max[lane] = larger ? value : lane_max[lane];
      lane_index[lane] = larger ? k + lane : lane_index[lane];
    }
  float best = -std::numeric_limits<float>::infinity();
  int64_t token = size;
  for (int lane = 0; lane < kLanes; ++lane)
    if (lane_max[lane] > best || (lane_max[lane] == best && lane_index[lane] < token)) {
      best = lane_max[lane];
      token = lane_index[lane];
    }
  for (; k < size; ++k)
    if (row[k] > best) {
      best = row[k];
      token = k;
    }
  if (token == size)  // every logit -inf (or NaN): log_softmax gives NaN
    return {0, std::numeric_limits<float>::quiet_NaN()};
  // Pass 2: log sum exp(x - max), every term at most 1.
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < size; ++i) sum += kvscope::exp_nonpositive(row[i] - best);
  return {token, -std::log(sum)};
}

}  // namespace

// tokens[r] = argmax(logits[r]) (the first on ties, as torch.argmax), logprobs[r] =
// log_softmax(logits[r])[tokens[r]], for contiguous fp32 logits [rows, vocab].
void greedy_tokens(const at::Tensor& logits, at::Tensor tokens, at::Tensor logprobs) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "greedy_tokens: contiguous fp32 logits [rows, vocab]");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && logprobs.scalar_type() == at::kFloat &&
              tokens.numel() == logits.size(0) && logprobs.numel() == logits.size(0) &&
              tokens.is_contiguous() && logprobs.is_contiguous(),
              "greedy_tokens: tokens int64 [rows], logprobs fp32 [rows]");
  const int64_t vocab = logits.size(1);
  const float* rows = logits.data_ptr<float>();
  int64_t* token_out = tokens.data_ptr<int64_t>();
  float* logprob_out = logprobs.data_ptr<float>();
  kvscope::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Pick pick = greedy_row(rows + r * vocab, vocab);
      token_out[r] = pick.token;
      logprob_out[r] = pick.logprob;
    }
  });
}

TORCH_LIBRARY_FRAGMENT(kvscope, m) {
  m.def("greedy_tokens(Tensor logits, Tensor(a!) tokens, Tensor(b!) logprobs) -> ()");
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) { m.impl("greedy_tokens", &greedy_tokens); }
