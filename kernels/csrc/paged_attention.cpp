// CPU paged attention and KV store over block tables: K/V are read in place through the
// block table (no gather copy, no padding), one call covers a ragged batch of decodes and
// prefill chunks, query heads of a GQA group share each K/V row, and the softmax runs
// online in fp32. A quantized cache (kernels/kv_quant.py: fp8 or int8 codes, a bf16 scale per
// row) is read the same way: codes widen to fp32 in registers, a key row's scale multiplies its
// widened row and a value row's its softmax weight. Built by kernels/cpu_extension.py with
// -march=native for the host CPU.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "cpu_common.h"
#include "cpu_ops.h"
#include "vec.hpp"
#include "work_pool.h"

namespace {

constexpr int kQueryTile = 16;  // query tokens of one sequence that share each K/V read
// Query rows (tokens times a GQA group's heads) of a prefill tile that runs as matrix products
// (run_prefill_tile): it lays its keys and values out for them once per chunk, so more rows
// share that work. 128: a 2,048-token prefill at Qwen3's heads faster than with 32 rows, and the
// tile's sums (~200 KB) stay in L2 (docs/performance-history.md, "A prefill's attention on AMX
// tiles").
constexpr int kTileQueryRows = 128;
// Rows of an AMX tile: a prefill tile's rows are padded to a multiple (run_prefill_tile).
using kvscope::amx::kTileRows;
// A chunk of up to this many query tokens (a speculative verification of up to 16 proposals)
// runs as decodes do: each token's rows sum their keys in the chunks and KV splits a decode
// of that token would, so its output is bit for bit that decode's and greedy output cannot
// drift with speculation. The tokens still share each K/V read where they split alike.
constexpr int kDecodeQueryTokens = 17;
// A decode's KV split is a multiple of this many keys, so the tokens of a verification chunk,
// whose key counts differ by a few, mostly split alike.
constexpr int kSplitAlign = 16;
// Keys scored before one online-softmax update (and asked for one chunk ahead): fewer keys per
// chunk mean more rescales (docs/performance-history.md, 'Paged attention (paged_attention.cpp)').
constexpr int kKeyChunk = 128;
// Keys of a chunk that an item over several KV heads (a decode) scores and adds up at every
// head before the next ones: a block's worth of slots, whose rows for all heads lie together.
constexpr int kKeyGroup = 16;
// Fewest keys one KV split of a decode gets: a chat decode of a few hundred tokens still
// splits, so both threads share its attention.
constexpr int kMinSplitKeys = 64;

using kvscope::load;
using kvscope::store;

inline float dot(const float* __restrict a, const float* __restrict b, int dim) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int d = 0; d < dim; ++d) sum += a[d] * b[d];
  return sum;
}

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

// Whether the portable path's key rows go through the vector layer: on AVX-512, with
// head_dim known at compile time, they widen by its loads (one vpmovsxbd per 16 int8 codes,
// where GCC widens a loop's byte codes one by one) and score 16 keys at a time
// (score_keys_fp32). On AVX2 the plain loops were the faster (docs/performance-history.md, 'The
// quantized KV cache').
template <int kDim>
constexpr bool kVectorRows =
#if defined(__AVX512F__)
    kDim > 0 && kDim % 16 == 0;
#else
    false;
#endif

// Rows of a key chunk, widened to fp32 (and de-quantized) once and then read by every query
// row of the tile (a GQA group's heads, prefill tokens): the conversion is paid once per
// element.
template <int kDim, typename KV>
inline void widen_rows(const KV* const* rows, int n, int dim, float* __restrict out) {
  for (int i = 0; i < n; ++i) {
    const KV* __restrict row = rows[i];
    const float scale = row_scale(row, dim);
    float* __restrict dst = out + static_cast<int64_t>(i) * dim;
    if constexpr (kVectorRows<kDim>) {
      using kvscope::vec::FP32Vec16;
#pragma GCC unroll 8
      for (int d = 0; d < kDim; d += 16) (FP32Vec16::load(row + d) * scale).store(dst + d);
    } else {
#pragma omp simd
      for (int d = 0; d < dim; ++d) dst[d] = load(row[d]) * scale;
    }
  }
}

// Asks for one cache row of `row_bytes` into L2 (kvscope::prefetch_to_l2).
template <typename KV>
inline void request_row(const KV* row, int64_t row_bytes) {
  for (int64_t line = 0; line < row_bytes; line += 64)
    kvscope::prefetch_to_l2(reinterpret_cast<const char*>(row) + line);
}

// Asks for the K and V rows of `n` keys at `offsets` (cache offsets at a KV head), `heads`
// KV heads each.
template <typename KV>
void request_rows(const KV* key_cache, const KV* value_cache, const int64_t* offsets, int n,
                  int heads, int64_t head_stride, int64_t row_bytes) {
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < heads; ++h)
      for (const KV* cache : {key_cache, value_cache})
        request_row(cache + offsets[i] + h * head_stride, row_bytes);
}

// The V rows of the next chunk's key group (at the same KV head), asked for while the value
// pass of this one runs, one row per key it adds up: spread out so, the requests overlap the
// arithmetic rather than filling the core's miss buffers at once and stalling it. (The K rows
// are asked for by the score pass.) The rows as pointers, not cache offsets: that keeps an add
// per row out of the value pass.
template <typename KV>
struct ValuesAhead {
  const KV* const* rows = nullptr;
  int n = 0;

  void prefetch(int i, int64_t row_bytes) const {
    if (i < n) request_row(rows[i], row_bytes);
  }
};

// acc[r] += sum_i weights[r * kKeyChunk + i] * value_rows[i] for R query rows at once: each
// value row is widened to fp32 in registers and used by all R rows, whose accumulators stay
// in registers across the chunk. One pass per query row instead (through an fp32 copy of the
// chunk) re-read every value from the cache G times and made the value pass most of a
// batch-64 decode's attention.
template <int kDim, int R, typename KV>
inline void accumulate_rows(float* __restrict acc, const float* __restrict weights,
                            const KV* const* value_rows, int n, const ValuesAhead<KV>& ahead) {
#if defined(__AVX512F__)
  // As vector registers by name: GCC kept the float arrays below on the stack, so every
  // multiply-add loaded and stored its accumulator. (Without AVX-512 the R x kDim / 16
  // vectors are twice as many AVX2 registers as there are: the arrays below instead.)
  if constexpr (kDim % 16 == 0) {
    using kvscope::vec::FP32Vec16;
    constexpr int kVectors = kDim / 16;
    FP32Vec16 sums[R][kVectors];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int v = 0; v < kVectors; ++v) sums[r][v] = FP32Vec16::load(acc + r * kDim + 16 * v);
    for (int i = 0; i < n; ++i) {
      ahead.prefetch(i, row_bytes<KV>(kDim));
      FP32Vec16 value[kVectors];
#pragma GCC unroll 16
      for (int v = 0; v < kVectors; ++v) value[v] = FP32Vec16::load(value_rows[i] + 16 * v);
      const float value_scale = row_scale(value_rows[i], kDim);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const FP32Vec16 w(weights[r * kKeyChunk + i] * value_scale);
#pragma GCC unroll 16
        for (int v = 0; v < kVectors; ++v) sums[r][v] = kvscope::vec::fma(w, value[v], sums[r][v]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int v = 0; v < kVectors; ++v) sums[r][v].store(acc + r * kDim + 16 * v);
    return;
  }
#endif
  float local[R][kDim];
  for (int r = 0; r < R; ++r)
#pragma omp simd
    for (int d = 0; d < kDim; ++d) local[r][d] = acc[r * kDim + d];
  for (int i = 0; i < n; ++i) {
    ahead.prefetch(i, row_bytes<KV>(kDim));
    const KV* __restrict row = value_rows[i];
    float value[kDim];
#pragma omp simd
    for (int d = 0; d < kDim; ++d) value[d] = load(row[d]);
    const float value_scale = row_scale(row, kDim);
    for (int r = 0; r < R; ++r) {
      const float w = weights[r * kKeyChunk + i] * value_scale;
#pragma omp simd
      for (int d = 0; d < kDim; ++d) local[r][d] += w * value[d];
    }
  }
  for (int r = 0; r < R; ++r)
#pragma omp simd
    for (int d = 0; d < kDim; ++d) acc[r * kDim + d] = local[r][d];
}

// The value pass of one chunk for all `rows` query rows (weights: row r's at r * kKeyChunk,
// zero past the keys it sees). With head_dim known at compile time, up to 256 / kDim rows
// (16 vector registers of accumulators) share each value row's load. The first pass over
// the chunk asks for the rows `ahead`.
template <int kDim, typename KV, int kRows = (kDim > 0 ? std::max(1, 256 / kDim) : 1)>
inline void accumulate_values(float* __restrict acc, const float* __restrict weights, int rows,
                              const KV* const* value_rows, int n, int dim, ValuesAhead<KV> ahead) {
  if constexpr (kDim > 0) {
    for (int r = 0; r < rows; r += kRows, ahead.n = 0) {
      if (rows - r < kRows) {  // the last few rows, as a smaller compile-time count
        if constexpr (kRows > 1)
          accumulate_values<kDim, KV, kRows - 1>(acc + r * kDim, weights + r * kKeyChunk, rows - r,
                                                 value_rows, n, dim, ahead);
        return;
      }
      accumulate_rows<kDim, kRows>(acc + r * kDim, weights + r * kKeyChunk, value_rows, n, ahead);
    }
  } else {
    for (int r = 0; r < rows; ++r, ahead.n = 0) {
      float* __restrict accr = acc + static_cast<int64_t>(r) * dim;
      for (int i = 0; i < n; ++i) {
        ahead.prefetch(i, row_bytes<KV>(dim));
        const KV* __restrict row = value_rows[i];
        const float w = weights[r * kKeyChunk + i] * row_scale(row, dim);
#pragma omp simd
        for (int d = 0; d < dim; ++d) accr[d] += w * load(row[d]);
      }
    }
  }
}

// scores[i] = scale * the lane sum of key_products(i) for i < n: 16 keys' lane-wise products
// are summed together by reduce_sum_16, not each by its own horizontal sum, which took more
// instructions than its key's products at head_dim 64.
template <typename Products>
inline void score_by_sixteen(int n, float scale, float* scores, Products key_products) {
  using kvscope::vec::FP32Vec16;
  for (int first = 0; first < n; first += 16) {
    const int count = std::min(16, n - first);
    FP32Vec16 partial[16];
    for (int i = 0; i < count; ++i) partial[i] = key_products(first + i);
    const FP32Vec16 chunk_scores = kvscope::vec::reduce_sum_16(partial) * FP32Vec16(scale);
    if (count == 16) {
      chunk_scores.store(scores + first);
    } else {
      float all[16];
      chunk_scores.store(all);
      std::copy_n(all, count, scores + first);
    }
  }
}

// scores[i] = q . keys[i] for i < n, fp32 query (scaled) and widened key rows of kDim.
template <int kDim>
inline void score_keys_fp32(const float* query, const float* keys, int n, float* scores) {
  using kvscope::vec::FP32Vec16;
  constexpr int kVectors = kDim / 16;
  FP32Vec16 q[kVectors];
  for (int c = 0; c < kVectors; ++c) q[c] = FP32Vec16::load(query + 16 * c);
  score_by_sixteen(n, 1.f, scores, [&](int i) {
    const float* key = keys + static_cast<int64_t>(i) * kDim;
    FP32Vec16 sum = q[0] * FP32Vec16::load(key);
    for (int c = 1; c < kVectors; ++c)
      sum = kvscope::vec::fma(q[c], FP32Vec16::load(key + 16 * c), sum);
    return sum;
  });
}

#if defined(__AVX512BF16__)
// A chunk's quantized key rows as bf16 rows in `out` (exact), and their scales.
template <int kDim, typename KV>
inline void codes_to_bf16(const KV* const* rows, int n, kvscope::bf16* out,
                          const kvscope::bf16** out_rows, float* scales) {
  for (int i = 0; i < n; ++i) {
    kvscope::bf16* row = out + static_cast<int64_t>(i) * kDim;
#pragma GCC unroll 8
    for (int d = 0; d < kDim; d += 16)
      kvscope::vec::FP32Vec16::load(rows[i] + d).store_exact(row + d);
    out_rows[i] = row;
    scales[i] = row_scale(rows[i], kDim);
  }
}

// scores[i] = scale * (q . key_rows[i]) for i < n, bf16 query and keys: vdpbf16ps takes the
// keys as they lie in the cache, with no widening to fp32, 32 products per instruction; the
// products are exact and summed in fp32, like the portable path's.
template <int kDim>
inline void score_keys_bf16(const kvscope::bf16* query, const kvscope::bf16* const* key_rows, int n,
                            float scale, float* scores) {
  using kvscope::vec::BF16Vec32;
  using kvscope::vec::FP32Vec16;
  constexpr int kPairs = kDim / 32;
  BF16Vec32 q[kPairs];
  for (int c = 0; c < kPairs; ++c) q[c] = BF16Vec32::load(query + 32 * c);
  score_by_sixteen(n, scale, scores, [&](int i) {
    FP32Vec16 sum;
    for (int c = 0; c < kPairs; ++c)
      sum = kvscope::vec::dot_accumulate(sum, q[c], BF16Vec32::load(key_rows[i] + 32 * c));
    return sum;
  });
}
#endif

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
  int tile_tokens;       // query tokens of a prefill chunk's tile

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

Scratch& thread_scratch(const Layout& L) {
  thread_local Scratch scratch;
  scratch.fit(L);
  return scratch;
}

// The end of the keys an item reads: its last query token sees keys up to its own position.
inline int visible_end(const WorkItem& item, const int32_t* seq_lens, const int32_t* starts) {
  const int query_len = starts[item.seq + 1] - starts[item.seq];
  return std::min(item.k_end, seq_lens[item.seq] - query_len + item.q_end);
}

// The cache offsets (K's and V's alike, at the item's first KV head) of up to kKeyChunk of an
// item's keys from `first`,
// walking its block table block by block rather than dividing each position by the block
// size; returns how many keys that is.
inline int key_offsets(const WorkItem& item, const Layout& L, const int32_t* tables,
                       const int32_t* seq_lens, const int32_t* starts, int first,
                       int64_t* offsets) {
  const int n = std::min(kKeyChunk, visible_end(item, seq_lens, starts) - first);
  const int32_t* table = tables + static_cast<int64_t>(item.seq) * L.table_stride;
  int block = first / L.block_size, slot = first % L.block_size;
  for (int i = 0; i < n; ++block, slot = 0) {
    const int64_t base = table[block] * L.block_stride + item.kv_begin * L.head_stride;
    for (; slot < L.block_size && i < n; ++slot, ++i) offsets[i] = base + slot * L.slot_stride;
  }
  return std::max(n, 0);
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
      Q* dst = out + (static_cast<int64_t>(start + item.token_of(j, L.group)) * L.num_heads +
                      item.head_of(j, L.group)) *
                         dim;
      const float inverse = row_sum[j] > 0.f ? 1.f / row_sum[j] : 0.f;
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

#if defined(__AVX512BF16__)
// A prefill tile's two small matrix products per key chunk (run_prefill_tile below), on the
// chunk's keys transposed once into pairs of dimensions (kt[p][i] = key i's dimensions 2p
// and 2p + 1) and its values interleaved once into pairs of keys (vt[i / 2][d] = dimension d
// of keys i and i + 1). `padded` counts the chunk's keys to a multiple of 32, zeros past its
// last.

// scores [rows][kKeyChunk] = Q K^T on pair dots, 8 rows x 32 keys a block: the sums stay in
// 16 registers beside the operands.
template <int kDim>
void score_by_pair_dots(const kvscope::bf16* const* q_rows, int rows, const uint32_t* kt,
                        int padded, float* scores) {
  using kvscope::bf16;
  using kvscope::vec::BF16Vec32;
  using kvscope::vec::FP32Vec16;
  kvscope::by_row_groups<8>(rows, [&](auto count, int64_t first) {
    constexpr int R = decltype(count)::value;
    for (int block = 0; block < padded; block += 32) {
      FP32Vec16 sums[R][2];
      for (auto& row : sums) row[0] = row[1] = FP32Vec16(0.f);
      for (int p = 0; p < kDim / 2; ++p) {
        const auto* keys = reinterpret_cast<const bf16*>(kt + p * kKeyChunk + block);
        const BF16Vec32 low = BF16Vec32::load(keys), high = BF16Vec32::load(keys + 32);
        for (int r = 0; r < R; ++r) {
          const BF16Vec32 q = BF16Vec32::broadcast_pair(q_rows[first + r] + 2 * p);
          sums[r][0] = kvscope::vec::dot_accumulate(sums[r][0], q, low);
          sums[r][1] = kvscope::vec::dot_accumulate(sums[r][1], q, high);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int half = 0; half < 2; ++half)
          sums[r][half].store(scores + (first + r) * kKeyChunk + block + 16 * half);
    }
  });
}

// acc [rows][kDim] += P V on pair dots, `weights` P's rows in bf16 ([rows][kKeyChunk]); the
// rows a group's sums (kDim / 16 vectors each) leave registers for: 6 at head_dim 64, 2 at
// 128, 1 at 256.
template <int kDim>
void add_values_by_pair_dots(const kvscope::bf16* weights, int rows, const uint32_t* vt, int padded,
                             float* acc) {
  using kvscope::bf16;
  using kvscope::vec::BF16Vec32;
  using kvscope::vec::FP32Vec16;
  constexpr int kVectors = kDim / 16;
  kvscope::by_row_groups<kDim == 64    ? 6
                         : kDim == 128 ? 2
                                       : 1>(rows, [&](auto count, int64_t first) {
    constexpr int R = decltype(count)::value;
    FP32Vec16 sums[R][kVectors];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVectors; ++v)
        sums[r][v] = FP32Vec16::load(acc + (first + r) * kDim + 16 * v);
    for (int i = 0; i < padded / 2; ++i) {
      BF16Vec32 values[kVectors];
      for (int v = 0; v < kVectors; ++v)
        values[v] = BF16Vec32::load(reinterpret_cast<const bf16*>(vt + i * kDim + 16 * v));
      for (int r = 0; r < R; ++r) {
        const BF16Vec32 w = BF16Vec32::broadcast_pair(weights + (first + r) * kKeyChunk + 2 * i);
        for (int v = 0; v < kVectors; ++v)
          sums[r][v] = kvscope::vec::dot_accumulate(sums[r][v], w, values[v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVectors; ++v) sums[r][v].store(acc + (first + r) * kDim + 16 * v);
  });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The same products as tile products: tdpbf16ps multiplies 16 rows x 32 bf16 of A by 16 pairs
// x 16 columns of B into 16 x 16 fp32 sums, sixteen vdpbf16ps' worth, and kt's and vt's rows
// are B tiles as they lie. Rows go 16 at a time (`blocks` of them, the query rows side by side
// and a last block's missing rows zeros), two blocks together where there are two: tiles 0-3
// hold the sums of block b and column half h in 2 b + h, 4 and 5 the blocks' A, 6 and 7 B's
// halves.

// A step of the products: A's rows of block 0 (`a`) and of block 1 (`a_next`, where `two`),
// `a_stride` bytes apart, times B's two halves (`b`, `b + 16`, rows `b_stride` bytes apart),
// added into tiles 0-3.
inline void multiply_step(const void* a, const void* a_next, int a_stride, const uint32_t* b,
                          int b_stride, bool two) {
  _tile_loadd(6, b, b_stride);
  _tile_loadd(7, b + 16, b_stride);
  _tile_loadd(4, a, a_stride);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  if (two) {
    _tile_loadd(5, a_next, a_stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// Tiles 0-3 from and to fp32 sums at `c` (block 1's `next_block` elements on), rows `stride`
// bytes apart. (Two functions: GCC's tile intrinsics take their tile as a literal.)
inline void load_sums(const float* c, int64_t next_block, int stride, bool two) {
  _tile_loadd(0, c, stride);
  _tile_loadd(1, c + 16, stride);
  if (two) {
    _tile_loadd(2, c + next_block, stride);
    _tile_loadd(3, c + next_block + 16, stride);
  }
}
inline void store_sums(float* c, int64_t next_block, int stride, bool two) {
  _tile_stored(0, c, stride);
  _tile_stored(1, c + 16, stride);
  if (two) {
    _tile_stored(2, c + next_block, stride);
    _tile_stored(3, c + next_block + 16, stride);
  }
}

template <int kDim>
void score_by_tiles(const kvscope::bf16* q, int blocks, const uint32_t* kt, int padded,
                    float* scores) {
  constexpr int kQueryBytes = kDim * 2, kPairRowBytes = kKeyChunk * 4, kScoreBytes = kKeyChunk * 4;
  for (int b = 0; b < blocks; b += 2) {
    const bool two = b + 1 < blocks;
    const kvscope::bf16* qb = q + b * kTileRows * kDim;
    for (int block = 0; block < padded; block += 32) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int p = 0; p < kDim / 2; p += 16)
        multiply_step(qb + 2 * p, qb + kTileRows * kDim + 2 * p, kQueryBytes,
                      kt + p * kKeyChunk + block, kPairRowBytes, two);
      store_sums(scores + b * kTileRows * kKeyChunk + block, kTileRows * kKeyChunk, kScoreBytes,
                 two);
    }
  }
}

template <int kDim>
void add_values_by_tiles(const kvscope::bf16* weights, int blocks, const uint32_t* vt, int padded,
                         float* acc) {
  constexpr int kWeightBytes = kKeyChunk * 2, kPairRowBytes = kDim * 4, kAccBytes = kDim * 4;
  for (int b = 0; b < blocks; b += 2) {
    const bool two = b + 1 < blocks;
    const kvscope::bf16* wb = weights + b * kTileRows * kKeyChunk;
    for (int d = 0; d < kDim; d += 32) {
      float* sums = acc + b * kTileRows * kDim + d;
      load_sums(sums, kTileRows * kDim, kAccBytes, two);
      for (int k = 0; k < padded; k += 32)
        multiply_step(wb + k, wb + kTileRows * kKeyChunk + k, kWeightBytes, vt + k / 2 * kDim + d,
                      kPairRowBytes, two);
      store_sums(sums, kTileRows * kDim, kAccBytes, two);
    }
  }
}
#endif

// softmax_step for a prefill tile's row, its weights narrowed to bf16 into `weights` (zeros for
// the keys it does not see); `row` holds its unscaled scores for the chunk's `padded` keys. Two
// passes over whole vectors with the unseen lanes masked, where softmax_step takes a pass per
// step and partial vectors at the visible keys' ends: on AMX this is the larger part of a
// tile's time.
//   A quantized cache's rows carry scales: a key's multiplies its score, a value's its weight
// (`key_scales`, `value_scales`: one per key, or null).
inline void softmax_to_bf16(const Layout& L, float* row, VisibleKeys keys, int padded, float scale,
                            const float* key_scales, const float* value_scales, float& row_max,
                            float& row_sum, float* acc, int dim, kvscope::bf16* weights) {
  using kvscope::vec::FP32Vec16;
  using kvscope::vec::i32x16;
  if (keys.m <= keys.f) {
    std::fill_n(weights, padded, kvscope::bf16{0});
    return;
  }
  const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  auto seen = [&](int i) { return (lane + i >= keys.f) & (lane + i < keys.m); };
  const FP32Vec16 nothing(-std::numeric_limits<float>::infinity()), zeros;
  FP32Vec16 top = nothing;
  for (int i = 0; i < padded; i += 16) {
    FP32Vec16 scores = FP32Vec16::load(row + i) * scale;
    if (key_scales) scores = scores * FP32Vec16::load(key_scales + i);
    if (L.soft_cap > 0.f)
      for (int l = 0; l < 16; ++l)
        scores.reg[l] = L.soft_cap * std::tanh(scores.reg[l] / L.soft_cap);
    scores = seen(i) ? scores.reg : nothing.reg;
    scores.store(row + i);
    top = FP32Vec16::max(top, scores);
  }
  raise_max(top.reduce_max(), row_max, row_sum, acc, dim);
  const FP32Vec16 subtrahend(row_max);
  FP32Vec16 sum;
  for (int i = 0; i < padded; i += 16) {
    const FP32Vec16 w = kvscope::vec::exp_nonpositive(FP32Vec16::load(row + i) - subtrahend);
    const FP32Vec16 visible = seen(i) ? w.reg : zeros.reg;
    sum += visible;
    (value_scales ? visible * FP32Vec16::load(value_scales + i) : visible).store(weights + i);
  }
  row_sum += sum.reduce_sum();
}

// A prefill tile (up to L.tile_tokens tokens of one sequence, the G query heads of one KV head
// each) as two small matrix products per key chunk, on AMX tiles where the process may use
// them, else on bf16 pair dots. run_item's row-at-a-time scoring ends every key's dot in a
// horizontal sum, and its value pass multiplies in fp32, at half the pair dots' rate; a long
// prompt's attention is compute-bound and grows with its square, so a 2,000-token prefill
// spent half its time there. P, the softmax weights, is rounded to bf16 (as torch's CPU flash
// attention rounds it) by the softmax between the products (softmax_to_bf16, row by row).
// A chunk's K or V rows at `offsets` as bf16 rows: a bf16 cache's where they lie, a quantized
// cache's codes converted into `buffer` (exactly) with their scales, zeros past the n keys to
// `padded`.
template <int kDim, typename KV>
inline void chunk_rows(const KV* cache, const int64_t* offsets, int n, int padded,
                       kvscope::bf16* buffer, const kvscope::bf16** rows, float* scales) {
  if constexpr (std::is_same_v<KV, kvscope::bf16>) {
    for (int i = 0; i < n; ++i) rows[i] = cache + offsets[i];
  } else {
    const KV* codes[kKeyChunk];
    for (int i = 0; i < n; ++i) codes[i] = cache + offsets[i];
    codes_to_bf16<kDim>(codes, n, buffer, rows, scales);
    std::fill(scales + n, scales + padded, 0.f);
  }
}

template <int kDim, typename KV>
void run_prefill_tile(const WorkItem& item, const Layout& L, const kvscope::bf16* query,
                      const KV* key_cache, const KV* value_cache, const int32_t* tables,
                      const int32_t* seq_lens, const int32_t* starts, float scale,
                      kvscope::bf16* out, Scratch& scratch) {
  using kvscope::bf16;
  using kvscope::vec::BF16Vec32;
  constexpr int kPairs = kDim / 2;
  const int G = L.group, start = starts[item.seq];
  const int context = seq_lens[item.seq] - (starts[item.seq + 1] - start);
  const int rows = item.rows(G);
  float* acc = scratch.acc.data();
  float* row_max = scratch.row_max.data();
  float* row_sum = scratch.row_sum.data();
  float* scores = scratch.scores.data();                               // row j's at j * kKeyChunk
  uint32_t* kt = scratch.pairs.data();                                 // [kPairs][kKeyChunk]
  uint32_t* vt = kt + kPairs * kKeyChunk;                              // [kKeyChunk / 2][kDim]
  bf16* weights = reinterpret_cast<bf16*>(vt + kKeyChunk / 2 * kDim);  // [rows][kKeyChunk]
  const bf16** q_rows = scratch.q_rows.data();
  for (int j = 0; j < rows; ++j)
    q_rows[j] = query + static_cast<int64_t>(start + item.token_of(j, G)) * L.query_stride +
                item.head_of(j, G) * kDim;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  // Tiles read whole blocks of 16 rows: the query rows side by side, zeros past `rows` in it
  // and in the weights.
  const bool tiles = kvscope::amx::permitted();
  const int blocks = (rows + kTileRows - 1) / kTileRows;
  const int padded_rows = tiles ? blocks * kTileRows : rows;
  bf16* q_tiles = scratch.q_tiles.data();
  if (tiles) {
    for (int j = 0; j < padded_rows; ++j) {
      bf16* row = q_tiles + static_cast<int64_t>(j) * kDim;
      if (j < rows)
        std::copy_n(q_rows[j], kDim, row);
      else
        std::fill_n(row, kDim, bf16{0});
    }
    kvscope::amx::configure_tiles();
  }
#else
  const int padded_rows = rows;
#endif
  std::fill_n(acc, static_cast<int64_t>(padded_rows) * kDim, 0.f);
  std::fill_n(row_max, rows, -std::numeric_limits<float>::infinity());
  std::fill_n(row_sum, rows, 0.f);
  std::fill(weights + static_cast<int64_t>(rows) * kKeyChunk,
            weights + static_cast<int64_t>(padded_rows) * kKeyChunk, bf16{0});
  auto score = [&](int padded) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (tiles) return score_by_tiles<kDim>(q_tiles, blocks, kt, padded, scores);
#endif
    score_by_pair_dots<kDim>(q_rows, rows, kt, padded, scores);
  };
  auto add_values = [&](int padded) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (tiles) return add_values_by_tiles<kDim>(weights, blocks, vt, padded, acc);
#endif
    add_values_by_pair_dots<kDim>(weights, rows, vt, padded, acc);
  };
  static const bf16 kZeroRow[kDim] = {};  // an odd chunk's last key's partner
  int64_t offsets[kKeyChunk];
  const bf16* key_rows[kKeyChunk];
  const bf16* value_rows[kKeyChunk];
  float key_scales[kKeyChunk], value_scales[kKeyChunk];  // a quantized cache's
  constexpr bool kScaled = kvscope::kQuantizedKV<KV>;
  bf16* converted = reinterpret_cast<bf16*>(scratch.keys.data());  // room for K's and V's
  const int k_end = visible_end(item, seq_lens, starts);
  for (int chunk = item.k_begin; chunk < k_end; chunk += kKeyChunk) {
    const int n = key_offsets(item, L, tables, seq_lens, starts, chunk, offsets);
    const int padded = (n + 31) / 32 * 32, key_pairs = (n + 1) / 2;
    chunk_rows<kDim>(key_cache, offsets, n, padded, converted, key_rows, key_scales);
    chunk_rows<kDim>(value_cache, offsets, n, padded, converted + kKeyChunk * kDim, value_rows,
                     value_scales);
    // 16 keys x 16 dimension pairs at a time, transposed in registers; keys past n are zeros.
    for (int first = 0; first < padded; first += 16)
      for (int p = 0; p < kPairs; p += 16) {
        const uint32_t* keys[16];
        for (int i = 0; i < 16; ++i)
          keys[i] =
              first + i < n ? reinterpret_cast<const uint32_t*>(key_rows[first + i]) + p : nullptr;
        kvscope::vec::transpose_16x16(keys, kt + p * kKeyChunk + first, kKeyChunk);
      }
    for (int i = 0; i < key_pairs; ++i) {
      const bf16* first = value_rows[2 * i];
      const bf16* second = 2 * i + 1 < n ? value_rows[2 * i + 1] : kZeroRow;
      for (int d = 0; d < kDim; d += 32) {
        BF16Vec32 low, high;
        BF16Vec32::interleave(BF16Vec32::load(first + d), BF16Vec32::load(second + d), low, high);
        low.store(reinterpret_cast<bf16*>(vt + i * kDim + d));
        high.store(reinterpret_cast<bf16*>(vt + i * kDim + d + 16));
      }
    }
    // Pairs past the chunk's keys meet zero weights: zeros, so no stale NaN makes them NaN.
    std::fill(vt + static_cast<int64_t>(key_pairs) * kDim, vt + padded / 2 * kDim, 0u);
    score(padded);
    for (int j = 0; j < rows; ++j) {
      softmax_to_bf16(L, scores + static_cast<int64_t>(j) * kKeyChunk,
                      visible_keys(L, context + item.token_of(j, G), chunk, n), padded, scale,
                      kScaled ? key_scales : nullptr, kScaled ? value_scales : nullptr, row_max[j],
                      row_sum[j], acc + static_cast<int64_t>(j) * kDim, kDim,
                      weights + static_cast<int64_t>(j) * kKeyChunk);
    }
    add_values(padded);
  }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (tiles) _tile_release();
#endif
  write_rows(item, L, start, kDim, acc, row_max, row_sum, out, nullptr, nullptr, nullptr);
}
#endif

// kDim > 0 fixes head_dim at compile time (with_head_dim), so the per-key dot products and
// updates unroll into straight vector code; 0 reads it from the layout.
template <typename Q, typename KV, int kDim>
void run_item(const WorkItem& item, const Layout& L, const Q* query, const KV* key_cache,
              const KV* value_cache, const int32_t* tables, const int32_t* seq_lens,
              const int32_t* starts, float scale, Q* out, float* part_acc, float* part_max,
              float* part_sum, Scratch& scratch, const WorkItem* next, bool first_asked_for) {
#if defined(__AVX512BF16__)
  if constexpr (kPairDots<Q, KV, kDim>) {
    if (starts[item.seq + 1] - starts[item.seq] > kDecodeQueryTokens)
      return run_prefill_tile<kDim, KV>(item, L, query, key_cache, value_cache, tables, seq_lens,
                                        starts, scale, out, scratch);
  }
#endif
  const int G = L.group, D = kDim > 0 ? kDim : L.dim;
  const int start = starts[item.seq];
  const int query_len = starts[item.seq + 1] - start;
  const int context = seq_lens[item.seq] - query_len;  // keys before the first new token
  const int num_q = item.rows(G), rows_per_kv_head = item.rows_per_kv_head(G);
  float* q = scratch.q.data();
  float* acc = scratch.acc.data();
  float* row_max = scratch.row_max.data();
  float* row_sum = scratch.row_sum.data();
  std::fill_n(acc, static_cast<int64_t>(num_q) * D, 0.f);
  std::fill_n(row_max, num_q, -std::numeric_limits<float>::infinity());
  std::fill_n(row_sum, num_q, 0.f);
  auto token_of = [&](int j) { return item.token_of(j, G); };
  auto head_of = [&](int j) { return item.head_of(j, G); };
  auto query_row = [&](int j) {
    return query + static_cast<int64_t>(start + token_of(j)) * L.query_stride + head_of(j) * D;
  };
  if constexpr (!kPairDots<Q, KV, kDim>)  // the portable path scores against scaled fp32 rows
    for (int j = 0; j < num_q; ++j)
      for (int d = 0; d < D; ++d)
        q[static_cast<int64_t>(j) * D + d] = load(query_row(j)[d]) * scale;
  const int k_end = visible_end(item, seq_lens, starts);
  // One key group's rows at one KV head (below: a block's worth of keys, or a one-head item's
  // whole chunk).
  const KV* key_rows[kKeyChunk];
  const KV* value_rows[kKeyChunk];
  float* keys = scratch.keys.data();
  const kvscope::bf16* code_rows[kKeyChunk];  // a quantized group's keys as bf16 (in `keys`)
  float key_scales[kKeyChunk];
  float* scores = scratch.scores.data();  // row j's at j * kKeyChunk
  // Row j's scaled scores for the keys of the group [g, g + gn) of the chunk from `chunk`
  // that it sees (key_rows, or `keys` widened), into its weights.
  auto score_group = [&](int j, int chunk, int n, int g, int gn) {
    float* weights = scores + static_cast<int64_t>(j) * kKeyChunk;
    const VisibleKeys visible = visible_keys(L, context + token_of(j), chunk, n);
    const int f = std::max(visible.f, g), m = std::min(visible.m, g + gn);
    if (m <= f) return;
#if defined(__AVX512BF16__)
    if constexpr (kPairDots<Q, KV, kDim> && kvscope::kQuantizedKV<KV>) {
      score_keys_bf16<kDim>(query_row(j), code_rows + (f - g), m - f, scale, weights + f);
      for (int i = f; i < m; ++i) weights[i] *= key_scales[i - g];
    } else if constexpr (kPairDots<Q, KV, kDim>) {
      score_keys_bf16<kDim>(query_row(j), key_rows + (f - g), m - f, scale, weights + f);
    }
#endif
    if constexpr (!kPairDots<Q, KV, kDim>) {
      const float* qj = q + static_cast<int64_t>(j) * D;
      const float* group_keys = keys + static_cast<int64_t>(f - g) * D;
      if constexpr (kVectorRows<kDim>)
        score_keys_fp32<kDim>(qj, group_keys, m - f, weights + f);
      else
        for (int i = f; i < m; ++i)
          weights[i] = dot(qj, group_keys + static_cast<int64_t>(i - f) * D, D);
    }
  };
  // Keys [chunk, chunk + kKeyChunk) sit in blocks anywhere in the pool, a pattern the
  // hardware prefetcher cannot follow: each chunk's rows are asked for while the chunk before
  // it is computed, its K rows by the score pass and its V rows by the value pass (half the
  // requests in each pass, not all in one: less time over an int8 cache;
  // docs/performance-history.md, 'Figures the code's comments quoted'), and the last chunk asks for
  // the first one of the thread's next item.
  int64_t offsets[2][kKeyChunk];
  const KV* values_ahead[kKeyChunk];
  int n = key_offsets(item, L, tables, seq_lens, starts, item.k_begin, offsets[0]);
  // Every later chunk is asked for while the one before it is computed; the first, when no
  // item before it on this thread asked for it, now, all at once: a single decode of a few
  // hundred keys is one or two chunks per thread, and read on demand they would come from
  // DRAM at the pace the L1 miss buffers allow.
  const int heads = item.kv_end - item.kv_begin;
  const int64_t bytes = row_bytes<KV>(D);
  if (!first_asked_for)
    request_rows(key_cache, value_cache, offsets[0], n, heads, L.head_stride, bytes);
  // One head's item (a prefill tile) takes its chunk whole: groups would only add trips of
  // its many rows' sums through memory (an int8 cache's 2,000-token prefill took longer:
  // docs/performance-history.md, "A decode's attention by key groups over every KV head").
  const int group = heads > 1 ? kKeyGroup : kKeyChunk;
  for (int chunk = item.k_begin, now = 0; n > 0; chunk += kKeyChunk, now ^= 1) {
    const bool last = chunk + kKeyChunk >= k_end;
    const WorkItem* ahead_item = last ? next : &item;  // whose keys come next, if any
    const int next_n = ahead_item
                           ? key_offsets(*ahead_item, L, tables, seq_lens, starts,
                                         last ? next->k_begin : chunk + kKeyChunk, offsets[now ^ 1])
                           : 0;
    const int heads_ahead = ahead_item ? ahead_item->kv_end - ahead_item->kv_begin : 0;
    // Both passes walk the chunk a key group at a time, every KV head within a group: a
    // group's slots hold all its heads' rows, and so are read together. Head by head over the
    // whole chunk instead, a pass took 256 bytes from each of 128 slots 2 KB apart (Qwen3's heads),
    // and a decode batch's attention ran longer (docs/performance-history.md, "A decode's attention
    // by key groups over every KV head").
    for (int g = 0; g < n; g += group) {
      const int gn = std::min(group, n - g);
      const int gn_ahead = std::clamp(next_n - g, 0, gn);
      for (int h = 0; h < heads; ++h) {  // a run of rows_per_kv_head rows
        const int64_t head_offset = h * L.head_stride;
        if (h < heads_ahead)
          for (int i = 0; i < gn_ahead; ++i)
            request_row(key_cache + offsets[now ^ 1][g + i] + head_offset, bytes);
        for (int i = 0; i < gn; ++i) key_rows[i] = key_cache + offsets[now][g + i] + head_offset;
        if constexpr (!kPairDots<Q, KV, kDim>) widen_rows<kDim>(key_rows, gn, D, keys);
        if constexpr (kPairDots<Q, KV, kDim> && kvscope::kQuantizedKV<KV>)
          codes_to_bf16<kDim>(key_rows, gn, reinterpret_cast<kvscope::bf16*>(keys), code_rows,
                              key_scales);
        for (int j = h * rows_per_kv_head; j < (h + 1) * rows_per_kv_head; ++j)
          score_group(j, chunk, n, g, gn);
      }
    }
    for (int j = 0; j < num_q; ++j)
      softmax_step(L, scores + static_cast<int64_t>(j) * kKeyChunk,
                   visible_keys(L, context + token_of(j), chunk, n), n, row_max[j], row_sum[j],
                   acc + static_cast<int64_t>(j) * D, D);
    for (int g = 0; g < n; g += group) {
      const int gn = std::min(group, n - g);
      const int gn_ahead = std::clamp(next_n - g, 0, gn);
      for (int h = 0; h < heads; ++h) {
        const int64_t head_offset = h * L.head_stride;
        for (int i = 0; i < gn; ++i)
          value_rows[i] = value_cache + offsets[now][g + i] + head_offset;
        const ValuesAhead<KV> ahead{values_ahead, h < heads_ahead ? gn_ahead : 0};
        for (int i = 0; i < ahead.n; ++i)
          values_ahead[i] = value_cache + offsets[now ^ 1][g + i] + head_offset;
        const int64_t first_row = static_cast<int64_t>(h) * rows_per_kv_head;
        accumulate_values<kDim>(acc + first_row * D, scores + first_row * kKeyChunk + g,
                                rows_per_kv_head, value_rows, gn, D, ahead);
      }
    }
    n = last ? 0 : next_n;
  }
  write_rows(item, L, start, D, acc, row_max, row_sum, out, part_acc, part_max, part_sum);
}

// Several KV splits of decodes merged by their softmax statistics: `first` is the first
// split's item; split s's row j is row first.partial + s * first.rows(group) + j.
struct SplitGroup {
  WorkItem first;
  int num_splits;
};

// How a decode's keys split over threads: [first_key, first_key + count * size) in `count`
// runs of `size` keys, the last one cut at the decode's own keys.
struct KeySplit {
  int first_key, size, count;
  bool operator==(const KeySplit& other) const {
    return first_key == other.first_key && size == other.size && count == other.count;
  }
};

template <typename Q, typename KV>
void attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
               const at::Tensor& block_tables, const at::Tensor& seq_lens,
               const at::Tensor& query_start_loc, double scale, int64_t window, double soft_cap,
               at::Tensor& out) {
  Layout L;
  L.num_heads = query.size(1);
  L.num_kv_heads = key_cache.size(2);
  L.group = L.num_heads / L.num_kv_heads;
  L.dim = query.size(2);
  L.block_size = key_cache.size(1);
  L.block_stride = key_cache.stride(0);
  L.slot_stride = key_cache.stride(1);
  L.head_stride = key_cache.stride(2);
  L.table_stride = block_tables.size(1);
  L.query_stride = query.stride(0);
  L.window = static_cast<int>(window);
  L.soft_cap = static_cast<float>(soft_cap);
  const bool tiles =
      with_head_dim(L.dim, [](auto dim) { return kPairDots<Q, KV, decltype(dim)::value>; });
  L.tile_tokens = tiles ? std::max(kQueryTile, kTileQueryRows / L.group) : kQueryTile;
  const int num_seqs = seq_lens.size(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();

  // A decode is one item over all its KV heads, so it reads each slot's K and V rows
  // (every head) in one contiguous run: one head at a time would read a third of every slot
  // per pass, scattered. A prefill chunk is compute-bound and tiles by
  // KV head and L.tile_tokens tokens. A short chunk runs as decodes (kDecodeQueryTokens).
  auto is_decode = [&](int s) { return starts[s + 1] - starts[s] <= kDecodeQueryTokens; };
  int64_t base_items = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int query_len = starts[s + 1] - starts[s];
    base_items +=
        is_decode(s) ? 1 : L.num_kv_heads * ((query_len + L.tile_tokens - 1) / L.tile_tokens);
  }
  // Few long decodes leave threads idle: split their keys so every thread has work, in a
  // multiple of the thread count where there are more splits than threads.
  const int threads = at::get_num_threads();
  const int64_t wanted_items = 2 * static_cast<int64_t>(threads);
  // The split of a decode whose token sees `seq_len` keys: it depends on the batch only
  // through base_items, which counts a decode and a verification chunk alike.
  auto decode_split = [&](int seq_len) {
    const int first_key = L.first_visible(seq_len - 1), num_keys = seq_len - first_key;
    int splits = 1;
    if (base_items < wanted_items) {
      const int64_t by_work = (wanted_items + base_items - 1) / base_items;
      splits = static_cast<int>(
          std::max<int64_t>(1, std::min<int64_t>(by_work, num_keys / kMinSplitKeys)));
      if (splits > threads) splits -= splits % threads;
    }
    const int size =
        ((num_keys + splits - 1) / splits + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
    return KeySplit{first_key, size, (num_keys + size - 1) / size};
  };
  std::vector<WorkItem> items;
  std::vector<SplitGroup> groups;
  int64_t partial_rows = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int query_len = starts[s + 1] - starts[s];
    if (query_len <= 0) continue;
    const int seq_len = lens[s], context = seq_len - query_len;
    if (!is_decode(s)) {
      // A tile's keys start where its first token's window does.
      for (int h = 0; h < L.num_kv_heads; ++h)
        for (int t = 0; t < query_len; t += L.tile_tokens)
          items.push_back({s, h, h + 1, t, std::min(query_len, t + L.tile_tokens),
                           L.first_visible(context + t), seq_len, -1});
      continue;
    }
    // Consecutive tokens that split alike share one set of items (and each K/V read).
    for (int t = 0; t < query_len;) {
      const KeySplit split = decode_split(context + t + 1);
      int end = t + 1;
      while (end < query_len && decode_split(context + end + 1) == split) ++end;
      WorkItem first{s, 0, L.num_kv_heads, t, end, split.first_key, context + end, -1};
      t = end;
      if (split.count == 1) {
        items.push_back(first);
        continue;
      }
      first.partial = partial_rows;
      groups.push_back({first, split.count});
      const int rows = first.rows(L.group);
      for (int i = 0; i < split.count; ++i) {
        WorkItem item = first;
        item.k_begin = split.first_key + i * split.size;
        item.k_end = std::min(first.k_end, item.k_begin + split.size);
        item.partial = first.partial + static_cast<int64_t>(i) * rows;
        items.push_back(item);
      }
      partial_rows += static_cast<int64_t>(split.count) * rows;
    }
  }
  std::vector<float> part_acc(partial_rows * L.dim), part_max(partial_rows), part_sum(partial_rows);
  const Q* q = kvscope::elements<Q>(query);
  const KV* k = kvscope::elements<KV>(key_cache);
  const KV* v = kvscope::elements<KV>(value_cache);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  Q* o = kvscope::elements<Q>(out);
  auto run_items = [&](auto run) {
    kvscope::parallel_for(0, static_cast<int64_t>(items.size()), 1,
                          [&](int64_t begin, int64_t end) {
      Scratch& scratch = thread_scratch(L);
      // `next`: the item this thread runs after it, whose first keys this one asks for.
      for (int64_t i = begin; i < end; ++i)
        run(items[i], L, q, k, v, tables, lens, starts, static_cast<float>(scale), o,
            part_acc.data(), part_max.data(), part_sum.data(), scratch,
            i + 1 < end ? &items[i + 1] : nullptr, i > begin);
    });
  };
  with_head_dim(L.dim, [&](auto dim) { run_items(run_item<Q, KV, decltype(dim)::value>); });
  for (const SplitGroup& group : groups) {
    const int rows = group.first.rows(L.group);
    for (int j = 0; j < rows; ++j) {
      auto row = [&](int split) { return group.first.partial + split * rows + j; };
      float merged_max = -std::numeric_limits<float>::infinity();
      for (int split = 0; split < group.num_splits; ++split)
        merged_max = std::max(merged_max, part_max[row(split)]);
      std::vector<float> acc(L.dim, 0.f);
      float total = 0.f;
      for (int split = 0; split < group.num_splits; ++split) {
        if (part_sum[row(split)] == 0.f) continue;
        const float weight = std::exp(part_max[row(split)] - merged_max);
        total += part_sum[row(split)] * weight;
        for (int d = 0; d < L.dim; ++d) acc[d] += part_acc[row(split) * L.dim + d] * weight;
      }
      const int64_t token = starts[group.first.seq] + group.first.token_of(j, L.group);
      Q* dst = o + (token * L.num_heads + group.first.head_of(j, L.group)) * L.dim;
      for (int d = 0; d < L.dim; ++d) store(dst[d], acc[d] / total);
    }
  }
}

bool quantized_kv(at::ScalarType type) {
  return type == at::ScalarType::Float8_e4m3fn || type == at::ScalarType::Float8_e5m2 ||
         type == at::kChar;
}

void check_inputs(const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                  const at::Tensor& out) {
  TORCH_CHECK(query.device().is_cpu(), "paged_attention_cpu: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4,
              "query [tokens, heads, dim], cache [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.is_contiguous(),
              "query rows [heads, dim] must be contiguous, out contiguous");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "out must match query");
  TORCH_CHECK(
      key_cache.sizes() == value_cache.sizes() && key_cache.strides() == value_cache.strides(),
      "key and value caches must share a layout");
  TORCH_CHECK(key_cache.stride(3) == 1, "cache rows must be contiguous in head_dim");
  const bool quantized = quantized_kv(key_cache.scalar_type());
  TORCH_CHECK(key_cache.size(3) == query.size(2) + (quantized ? kvscope::kScaleElements : 0),
              "cache rows must be head_dim values, or head_dim codes and a scale (quantized)");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2,
              "block_tables: contiguous int32 [seqs, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "seq_lens: contiguous int32");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous() &&
                  query_start_loc.numel() == seq_lens.numel() + 1,
              "query_start_loc: contiguous int32 [seqs + 1]");
}

// fn(Q{}, KV{}) for a float or bf16 tensor and a quantized cache's code type.
template <typename Fn>
void with_quantized(at::ScalarType values, at::ScalarType codes, Fn fn) {
  auto with_codes = [&](auto value) {
    if (codes == at::ScalarType::Float8_e4m3fn)
      fn(value, kvscope::fp8_e4m3{});
    else if (codes == at::ScalarType::Float8_e5m2)
      fn(value, kvscope::fp8_e5m2{});
    else
      fn(value, int8_t{});
  };
  if (values == at::kFloat)
    with_codes(float{});
  else
    with_codes(kvscope::bf16{});
}

// Quantizes each row of `rows` values [heads, dim] (a token's K or V) into its cache slot:
// codes value / scale with scale = max |value| / kCodeMax rounded to bf16, exactly as
// kernels/kv_quant.quantize does.
template <typename T, typename Code>
void quantize_rows(const at::Tensor& rows, at::Tensor& cache, const int64_t* slots) {
  const int64_t tokens = rows.size(0), heads = rows.size(1), dim = rows.size(2);
  const int64_t block_size = cache.size(1);
  const T* values = kvscope::elements<T>(rows);
  Code* codes = kvscope::elements<Code>(cache);
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    const int64_t base =
        (slots[t] / block_size) * cache.stride(0) + (slots[t] % block_size) * cache.stride(1);
    for (int64_t h = 0; h < heads; ++h) {
      const T* row = values + t * rows.stride(0) + h * rows.stride(1);
      Code* target = codes + base + h * cache.stride(2);
      float amax = 0.f;
      for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(load(row[d])));
      const kvscope::bf16 scale_bits =
          kvscope::bf16_bits(amax > 0.f ? amax / kvscope::kCodeMax<Code> : 1.f);
      const float scale = load(scale_bits);
      for (int64_t d = 0; d < dim; ++d)
        store(target[d],
              std::clamp(load(row[d]) / scale, -kvscope::kCodeMax<Code>, kvscope::kCodeMax<Code>));
      std::memcpy(target + dim, &scale_bits, sizeof(scale_bits));
    }
  }
}

}  // namespace

// out[t, h] = softmax(q[t, h] . K) V over each sequence's paged keys up to t's position (the
// last `window` of them when window > 0; table entries before those are never read), the
// scores soft-capped when soft_cap > 0.
void paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                     at::Tensor out, int64_t window, double soft_cap) {
  check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out);
  TORCH_CHECK(window >= 0 && soft_cap >= 0,
              "paged_attention_cpu: window and soft_cap must be >= 0");
  if (query.size(0) == 0) return;
  const auto q_type = query.scalar_type(), kv_type = key_cache.scalar_type();
  if (q_type == at::kFloat && kv_type == at::kFloat)
    attention<float, float>(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                            scale, window, soft_cap, out);
  else if (q_type == at::kBFloat16 && kv_type == at::kBFloat16)
    attention<kvscope::bf16, kvscope::bf16>(query, key_cache, value_cache, block_tables, seq_lens,
                                            query_start_loc, scale, window, soft_cap, out);
  else if (q_type == at::kFloat && kv_type == at::kBFloat16)
    attention<float, kvscope::bf16>(query, key_cache, value_cache, block_tables, seq_lens,
                                    query_start_loc, scale, window, soft_cap, out);
  else if ((q_type == at::kFloat || q_type == at::kBFloat16) && quantized_kv(kv_type))
    with_quantized(q_type, kv_type, [&](auto q_element, auto kv_element) {
      attention<decltype(q_element), decltype(kv_element)>(query, key_cache, value_cache,
                                                           block_tables, seq_lens, query_start_loc,
                                                           scale, window, soft_cap, out);
    });
  else
    TORCH_CHECK(false, "paged_attention_cpu: unsupported query/cache dtypes ", q_type, "/",
                kv_type);
}

// Copy each token's K/V rows [kv_heads, dim] into its slot, quantizing them for a quantized
// cache (K/V float or bf16 then); slot -1 is skipped.
void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
              at::Tensor value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key_cache.stride(3) == 1,
              "store_kv_cpu: rows must be contiguous in head_dim");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping: contiguous int64");
  if (quantized_kv(key_cache.scalar_type())) {
    TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type() &&
                    key.scalar_type() == value.scalar_type() &&
                    (key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16) &&
                    key_cache.size(3) == key.size(2) + kvscope::kScaleElements,
                "store_kv_cpu: a quantized cache takes float or bf16 K/V, rows of head_dim "
                "codes and a scale");
    with_quantized(key.scalar_type(), key_cache.scalar_type(), [&](auto value_type, auto code) {
      using T = decltype(value_type);
      using Code = decltype(code);
      quantize_rows<T, Code>(key, key_cache, slot_mapping.data_ptr<int64_t>());
      quantize_rows<T, Code>(value, value_cache, slot_mapping.data_ptr<int64_t>());
    });
    return;
  }
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() &&
                  value.scalar_type() == value_cache.scalar_type(),
              "store_kv_cpu: K/V must have the cache's dtype");
  const int64_t tokens = key.size(0), heads = key.size(1), bytes = key.size(2) * key.element_size();
  const int64_t block_size = key_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const auto* k = static_cast<const char*>(key.data_ptr());
  const auto* v = static_cast<const char*>(value.data_ptr());
  const int64_t e = key.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t base =
        (slot / block_size) * key_cache.stride(0) + (slot % block_size) * key_cache.stride(1);
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(kc + (base + h * key_cache.stride(2)) * e,
                  k + (t * key.stride(0) + h * key.stride(1)) * e, bytes);
      std::memcpy(vc + (base + h * value_cache.stride(2)) * e,
                  v + (t * value.stride(0) + h * value.stride(1)) * e, bytes);
    }
  }
}
