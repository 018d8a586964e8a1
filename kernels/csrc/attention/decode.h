// Paged attention a query row at a time (run_item): every decode (and verification chunk),
// and the prefill chunks that prefill_tiles.h does not take (a float query, a head_dim not
// fixed at compile time, a CPU without AVX512-BF16). Each key chunk's rows are scored against
// every query row of the item, one online-softmax step follows, and the value pass adds the
// rows up for several query rows at once; the next chunk's rows are asked for from memory
// while this one is computed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attention/common.h"
#include "attention/prefill_tiles.h"
#include "attention/quantized.h"
#include "cpu_common.h"
#include "vec.hpp"

namespace kvscope::attention {

// Keys of a chunk that an item over several KV heads (a decode) scores and adds up at every
// head before the next ones: a block's worth of slots, whose rows for all heads lie together.
constexpr int kKeyGroup = 16;
// Keys of a decode's chunk (an item of kDecodeQueryTokens or fewer), of the kKeyChunk the
// scratch holds: each chunk's rows are asked for while the one before it is computed, and at
// 64 keys rather than 128 a batch-64 decode read its K/V at 1.1-2x the rate, on Qwen3's heads
// and SmolLM2's alike (docs/performance-history.md, "Decode attention in 64-key chunks").
constexpr int kDecodeKeyChunk = 64;

// q . k summed in an order the source fixes: eight running sums (lane l takes the products
// d = l mod 8), added up as FP32Vec8::reduce_sum does, then the last dim mod 8 products. An `omp
// simd` reduction left the order to the compiler, and on the AVX2 and x86-64 builds (GCC 12)
// a key's score then differed in its last bits between a verification chunk and the decode
// of the same token, so greedy output could drift with speculation.
inline float dot(const float* __restrict a, const float* __restrict b, int dim) {
  using kvscope::vec::f32x8;
  using kvscope::vec::load_unaligned;
  f32x8 lanes{};
  int d = 0;
  for (; d + 8 <= dim; d += 8) lanes += load_unaligned<f32x8>(a + d) * load_unaligned<f32x8>(b + d);
  float sum = kvscope::vec::FP32Vec8{lanes}.reduce_sum();
  for (; d < dim; ++d) sum += a[d] * b[d];
  return sum;
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

// One work item; a prefill chunk that the tiles take goes to run_prefill_tile. kDim > 0 fixes
// head_dim at compile time (with_head_dim), so the per-key dot products and updates unroll
// into straight vector code; 0 reads it from the layout.
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
  const int heads = item.kv_end - item.kv_begin;
  const int64_t bytes = row_bytes<KV>(D);
  const int chunk_keys = query_len <= kDecodeQueryTokens ? kDecodeKeyChunk : kKeyChunk;
  int n = key_offsets(item, L, tables, seq_lens, starts, item.k_begin, offsets[0], chunk_keys);
  // Every later chunk is asked for while the one before it is computed; the first, when no
  // item before it on this thread asked for it, now, all at once: a single decode of a few
  // hundred keys is a few chunks per thread, and read on demand they would come from DRAM at
  // the pace the L1 miss buffers allow.
  if (!first_asked_for)
    request_rows(key_cache, value_cache, offsets[0], n, heads, L.head_stride, bytes);
  // One head's item (a prefill tile) takes its chunk whole: groups would only add trips of
  // its many rows' sums through memory (an int8 cache's 2,000-token prefill took longer:
  // docs/performance-history.md, "A decode's attention by key groups over every KV head").
  const int group = heads > 1 ? kKeyGroup : kKeyChunk;
  for (int chunk = item.k_begin, now = 0; n > 0; chunk += chunk_keys, now ^= 1) {
    const bool last = chunk + chunk_keys >= k_end;
    const WorkItem* ahead_item = last ? next : &item;  // whose keys come next, if any
    const int next_n = ahead_item
                           ? key_offsets(*ahead_item, L, tables, seq_lens, starts,
                                         last ? next->k_begin : chunk + chunk_keys,
                                         offsets[now ^ 1], chunk_keys)
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

}  // namespace kvscope::attention
