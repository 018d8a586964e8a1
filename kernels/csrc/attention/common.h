// What paged attention's paths share (decode.h's rows, prefill_tiles.h's tiles, the entry
// points in paged_attention.cpp): the tuning constants they agree on, the work item and the
// layout of the call, the per-thread scratch, a cache row's helpers, the walk over a block
// table, the online-softmax step and the compile-time head_dim.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "cpu_common.h"

namespace kvscope::attention {

// Rows of an AMX tile: a prefill tile's rows are padded to a multiple (run_prefill_tile).
using kvscope::amx::kTileRows;
// A chunk of up to this many query tokens (a speculative verification of up to 16 proposals)
// runs as decodes do: each token's rows sum their keys in the chunks and KV splits a decode
// of that token would, so its output is bit for bit that decode's and greedy output cannot
// drift with speculation. The tokens still share each K/V read where they split alike.
constexpr int kDecodeQueryTokens = 17;
// Keys scored before one online-softmax update (and asked for one chunk ahead): fewer keys per
// chunk mean more rescales (docs/performance-history.md, 'Paged attention (paged_attention.cpp)').
constexpr int kKeyChunk = 128;

// A cache row's scale: in a quantized cache the bf16 after its `dim` codes, else 1 (which the
// compiler folds away where it multiplies).
template <typename KV>
inline float row_scale(const KV* row, int dim) {
  if constexpr (kvscope::kQuantizedKV<KV>) {
    kvscope::bf16 bits;
    std::memcpy(&bits, row + dim, sizeof(bits));
    return load(bits);
  } else {
    return 1.f;
  }
}

// Bytes of one cache row: its values, or its codes and scale.
template <typename KV>
constexpr int64_t row_bytes(int dim) {
  return (dim + (kvscope::kQuantizedKV<KV> ? kvscope::kScaleElements : 0)) *
         static_cast<int64_t>(sizeof(KV));
}

// One unit of work: query tokens [q_begin, q_end) of sequence `seq` (offsets within its
// query), every query head of KV heads [kv_begin, kv_end), over keys [k_begin, k_end).
// Its query rows are ordered by KV head, then token, then head within the GQA group.
struct WorkItem {
  int seq, kv_begin, kv_end, q_begin, q_end, k_begin, k_end;
  int64_t partial;  // -1: normalise into `out`; else the first row of the split buffers

  int rows_per_kv_head(int group) const { return (q_end - q_begin) * group; }
  int rows(int group) const { return (kv_end - kv_begin) * rows_per_kv_head(group); }
  // Query row j's token (an offset within the sequence's query) and head.
  int token_of(int j, int group) const { return q_begin + j % rows_per_kv_head(group) / group; }
  int head_of(int j, int group) const {
    return (kv_begin + j / rows_per_kv_head(group)) * group + j % rows_per_kv_head(group) % group;
  }
};

struct Layout {
  int num_heads, num_kv_heads, group, dim, block_size;
  int64_t block_stride, slot_stride, head_stride;  // cache strides
  int64_t table_stride;
  int64_t query_stride;  // between tokens: rows may be views into a fused projection
  int window;            // > 0: position p sees keys (p - window, p] only
  float soft_cap;        // > 0: scores become soft_cap * tanh(score / soft_cap)
  // Per query head: a logit that joins the softmax's denominator as a key with no value
  // (gpt-oss's attention sinks); null: none.
  const float* sinks;
  int tile_tokens;  // query tokens of a prefill chunk's tile

  // The first key position a query at `position` sees.
  int first_visible(int position) const {
    return window > 0 ? std::max(0, position - window + 1) : 0;
  }
};

// Per-thread scratch, kept between calls and grown to the largest layout seen: a decode step
// calls the op once per layer, and allocating and zeroing it each time cost a sizeable part
// of a short sequence's attention. run_item writes every element before reading it.
struct Scratch {
  // `keys`: a chunk's key rows widened (run_item), or a quantized chunk's K and V rows as
  // bf16, side by side (run_prefill_tile).
  std::vector<float> q, acc, row_max, row_sum, keys, scores;
  // run_prefill_tile's: the chunk's keys and values as pairs, the rows' bf16 weights, and
  // where each query row lies.
  std::vector<uint32_t> pairs;
  std::vector<const kvscope::bf16*> q_rows;
  std::vector<kvscope::bf16> q_tiles;  // on AMX, the query rows side by side
  void fit(const Layout& L) {
    auto at_least = [](auto& buffer, int64_t size) {
      if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
    };
    // Query rows of the largest item: a prefill tile of one KV head, padded to whole blocks
    // of rows, or decodes of all.
    const int64_t tile_rows = (L.tile_tokens * L.group + kTileRows - 1) / kTileRows * kTileRows;
    const int64_t rows = std::max<int64_t>(tile_rows, kDecodeQueryTokens * L.num_heads);
    at_least(q, rows * L.dim);
    at_least(acc, q.size());
    at_least(row_max, rows);
    at_least(row_sum, rows);
    at_least(keys, static_cast<int64_t>(kKeyChunk) * L.dim);
    at_least(scores, rows * kKeyChunk);
    at_least(pairs, kKeyChunk * L.dim + rows * kKeyChunk / 2);
    at_least(q_rows, rows);
    at_least(q_tiles, rows * L.dim);
  }
};

inline Scratch& thread_scratch(const Layout& L) {
  thread_local Scratch scratch;
  scratch.fit(L);
  return scratch;
}

// The end of the keys an item reads: its last query token sees keys up to its own position.
inline int visible_end(const WorkItem& item, const int32_t* seq_lens, const int32_t* starts) {
  const int query_len = starts[item.seq + 1] - starts[item.seq];
  return std::min(item.k_end, seq_lens[item.seq] - query_len + item.q_end);
}

// The cache offsets (K's and V's alike, at the item's first KV head) of up to max_keys of an
// item's keys from `first`,
// walking its block table block by block rather than dividing each position by the block
// size; returns how many keys that is.
inline int key_offsets(const WorkItem& item, const Layout& L, const int32_t* tables,
                       const int32_t* seq_lens, const int32_t* starts, int first,
                       int64_t* offsets, int max_keys = kKeyChunk) {
  const int n = std::min(max_keys, visible_end(item, seq_lens, starts) - first);
  const int32_t* table = tables + static_cast<int64_t>(item.seq) * L.table_stride;
  int block = first / L.block_size, slot = first % L.block_size;
  for (int i = 0; i < n; ++block, slot = 0) {
    const int64_t base = table[block] * L.block_stride + item.kv_begin * L.head_stride;
    for (; slot < L.block_size && i < n; ++slot, ++i) offsets[i] = base + slot * L.slot_stride;
  }
  return std::max(n, 0);
}

// The softmax's denominator of a query row of `head` whose keys' exponentials, each taken
// relative to `row_max`, sum to `row_sum`: with a sink, its exponential joins them. (A sink far
// above every score makes it inf, and the row's output 0: the limit of the exact result.)
inline float softmax_denominator(const Layout& L, int head, float row_max, float row_sum) {
  return L.sinks ? row_sum + std::exp(L.sinks[head] - row_max) : row_sum;
}

// An item's query rows out of their accumulators: normalised into `out`, or (a KV split of a
// decode) kept with their softmax statistics for the merge.
template <typename Q>
void write_rows(const WorkItem& item, const Layout& L, int start, int dim, const float* acc,
                const float* row_max, const float* row_sum, Q* out, float* part_acc,
                float* part_max, float* part_sum) {
  for (int j = 0; j < item.rows(L.group); ++j) {
    const float* accj = acc + static_cast<int64_t>(j) * dim;
    if (item.partial < 0) {
      const int head = item.head_of(j, L.group);
      Q* dst = out + (static_cast<int64_t>(start + item.token_of(j, L.group)) * L.num_heads +
                      head) *
                         dim;
      const float denominator = softmax_denominator(L, head, row_max[j], row_sum[j]);
      const float inverse = denominator > 0.f ? 1.f / denominator : 0.f;
      for (int d = 0; d < dim; ++d) store(dst[d], accj[d] * inverse);
    } else {
      const int64_t row = item.partial + j;
      part_max[row] = row_max[j];
      part_sum[row] = row_sum[j];
      std::memcpy(part_acc + row * dim, accj, sizeof(float) * dim);
    }
  }
}

// The keys [f, m) of a chunk from key `chunk`, n keys long, that a query at `position` sees.
struct VisibleKeys {
  int f, m;
};
inline VisibleKeys visible_keys(const Layout& L, int position, int chunk, int n) {
  const int m = std::max(0, std::min(n, position + 1 - chunk));
  return {std::min(m, std::max(0, L.first_visible(position) - chunk)), m};
}

// A row's running max raised to `chunk_max` where that is higher: its sum and accumulator
// (dim values) rescaled by exp(old max - new max), 0 for its first keys.
inline void raise_max(float chunk_max, float& row_max, float& row_sum, float* acc, int dim) {
  if (chunk_max <= row_max) return;
  const float correction = std::exp(row_max - chunk_max);
  row_sum *= correction;
#pragma omp simd
  for (int d = 0; d < dim; ++d) acc[d] *= correction;
  row_max = chunk_max;
}

// A query row's online-softmax step over one chunk: `weights` holds its scaled scores for
// the keys [f, m) it sees and becomes their softmax weights (exp(score - running max)),
// zeros elsewhere among the chunk's n keys; the row's running max and sum are updated and its
// accumulator `acc` (dim values) rescaled when the max grows.
inline void softmax_step(const Layout& L, float* weights, VisibleKeys keys, int n, float& row_max,
                         float& row_sum, float* acc, int dim) {
  const int f = keys.f, m = keys.m;
  std::fill(weights, weights + f, 0.f);
  std::fill(weights + m, weights + n, 0.f);
  if (m == f) return;
  if (L.soft_cap > 0.f)
    for (int i = f; i < m; ++i) weights[i] = L.soft_cap * std::tanh(weights[i] / L.soft_cap);
  float chunk_max = row_max;
  // A conditional, not std::max: GCC leaves a std::max reduction scalar, a chain of
  // vmaxss that took a sixth of a long decode's attention.
#pragma omp simd reduction(max : chunk_max)
  for (int i = f; i < m; ++i) chunk_max = weights[i] > chunk_max ? weights[i] : chunk_max;
  raise_max(chunk_max, row_max, row_sum, acc, dim);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int i = f; i < m; ++i) {
    weights[i] = kvscope::exp_nonpositive(weights[i] - chunk_max);
    sum += weights[i];
  }
  row_sum += sum;
}

// body(std::integral_constant<int, kDim>) with head_dim as a compile-time kDim where the kernels
// are built for it (64, 128 and Gemma 3's 256), else kDim = 0 (read from the layout).
template <typename Body>
auto with_head_dim(int dim, Body&& body) {
  if (dim == 64) return body(std::integral_constant<int, 64>{});
  if (dim == 128) return body(std::integral_constant<int, 128>{});
  if (dim == 256) return body(std::integral_constant<int, 256>{});
  return body(std::integral_constant<int, 0>{});
}

// Whether bf16 pair dots take the products: a bf16 query over a bf16 or quantized cache (a
// quantized cache's codes are bf16 values exactly: int8's 8 bits, fp8's 4 significant bits),
// head_dim a multiple of 32 fixed at compile time (kDim, below). A decode's rows then score
// keys as bf16 rows, and a prefill chunk runs as tiles of matrix products (run_prefill_tile).
template <typename Q, typename KV, int kDim>
constexpr bool kPairDots =
#if defined(__AVX512BF16__)
    std::is_same_v<Q, kvscope::bf16> &&
    (std::is_same_v<KV, kvscope::bf16> || kvscope::kQuantizedKV<KV>) && kDim > 0 && kDim % 32 == 0;
#else
    false;
#endif

}  // namespace kvscope::attention
