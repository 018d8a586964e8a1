// Greedy decoding's pick from fp32 logits: each row's first largest logit and its
// log-probability, in two passes over the row (the largest value and where it is; then the
// sum of exp(x - max)), rather than torch's argmax, log_softmax and gather: argmax is a scalar
// loop, and log_softmax writes the whole row and wakes torch's sleeping OpenMP threads for it. A
// single row is split across the threads (each piece sums against its own largest value; the pieces
// are rescaled to the row's when they meet), and the picks come back as Python lists, not tensors
// to convert.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "work_pool.h"

namespace {

constexpr int kLanes = 16;

// A piece of a row: its first largest value, where that is (`size` of the row if none: every
// value -inf or NaN), and the sum of exp(x - that value) over the piece.
struct Piece {
  float best;
  int64_t token;
  double sum;
};

Piece greedy_piece(const float* __restrict row, int64_t first, int64_t last, int64_t size) {
  // Pass 1, per lane: the largest value and the first index holding it.
  float lane_max[kLanes];
  int64_t lane_index[kLanes];
  for (int lane = 0; lane < kLanes; ++lane) {
    lane_max[lane] = -std::numeric_limits<float>::infinity();
    lane_index[lane] = size;
  }
  int64_t k = first;
  for (; k + kLanes <= last; k += kLanes)
#pragma omp simd
    for (int lane = 0; lane < kLanes; ++lane) {
      const float value = row[k + lane];
      const bool larger = value > lane_max[lane];
      lane_max[lane] = larger ? value : lane_max[lane];
      lane_index[lane] = larger ? k + lane : lane_index[lane];
    }
  Piece piece{-std::numeric_limits<float>::infinity(), size, 0.0};
  for (int lane = 0; lane < kLanes; ++lane)
    if (lane_max[lane] > piece.best ||
        (lane_max[lane] == piece.best && lane_index[lane] < piece.token)) {
      piece.best = lane_max[lane];
      piece.token = lane_index[lane];
    }
  for (; k < last; ++k)
    if (row[k] > piece.best) {
      piece.best = row[k];
      piece.token = k;
    }
  if (piece.token == size) return piece;
  // Pass 2: sum exp(x - best), every term at most 1. A float sum over the whole row drops
  // most terms of a wide vocabulary: they lie below half an ulp of a sum that already holds
  // the largest term's 1 (-5e-5 in the logprob over 49k logits when the loop ran 8 lanes
  // wide, on AVX2). So each lane sums kSumBlock / kLanes terms in float, where at most that
  // many small terms can be lost, and the block sums add up in double. A double sum term by
  // term does not vectorize (GCC leaves it scalar: 7 cycles a logit).
  constexpr int64_t kSumBlock = 256;
  const float best = piece.best;
  double wide[kLanes] = {};
  k = first;
  for (; k + kSumBlock <= last; k += kSumBlock) {
    float block[kLanes] = {};
    for (int64_t j = k; j < k + kSumBlock; j += kLanes)
#pragma omp simd
      for (int lane = 0; lane < kLanes; ++lane)
        block[lane] += kvscope::exp_nonpositive(row[j + lane] - best);
    for (int lane = 0; lane < kLanes; ++lane) wide[lane] += block[lane];
  }
  double sum = 0.0;
  for (; k < last; ++k) sum += kvscope::exp_nonpositive(row[k] - best);
  for (int lane = 0; lane < kLanes; ++lane) sum += wide[lane];
  piece.sum = sum;
  return piece;
}

// The row's token and logprob from its pieces, in order (so the first largest value wins).
std::pair<int64_t, double> combine(const Piece* pieces, int64_t count, int64_t size) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t token = size;
  for (int64_t p = 0; p < count; ++p)
    if (pieces[p].token != size && pieces[p].best > best) {
      best = pieces[p].best;
      token = pieces[p].token;
    }
  if (token == size)  // every logit -inf (or NaN): log_softmax gives NaN
    return {0, std::numeric_limits<double>::quiet_NaN()};
  double sum = 0.0;
  for (int64_t p = 0; p < count; ++p)
    if (pieces[p].token != size) sum += pieces[p].sum * std::exp(double(pieces[p].best) - best);
  return {token, -std::log(sum)};
}

}  // namespace

// For contiguous fp32 logits [rows, vocab]: argmax(logits[r]) (the first on ties, as
// torch.argmax) and log_softmax(logits[r]) at it, for every row, as two lists.
std::tuple<std::vector<int64_t>, std::vector<double>> greedy_tokens(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "greedy_tokens: contiguous fp32 logits [rows, vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  // Fewer rows than threads: each row in as many pieces as there are threads per row. The
  // count depends only on rows and threads, so a row's sum is the same whoever runs a piece.
  const int64_t per_row = std::max<int64_t>(1, at::get_num_threads() / std::max<int64_t>(rows, 1));
  const int64_t length = (vocab + per_row - 1) / per_row;
  std::vector<Piece> pieces(rows * per_row);
  const float* data = logits.data_ptr<float>();
  kvscope::parallel_for(0, rows * per_row, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t first = task % per_row * length;
      pieces[task] = greedy_piece(data + task / per_row * vocab, first,
                                  std::min(vocab, first + length), vocab);
    }
  });
  std::vector<int64_t> tokens(rows);
  std::vector<double> logprobs(rows);
  for (int64_t r = 0; r < rows; ++r)
    std::tie(tokens[r], logprobs[r]) = combine(pieces.data() + r * per_row, per_row, vocab);
  return {tokens, logprobs};
}
