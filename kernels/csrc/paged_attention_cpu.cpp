// CPU paged attention and KV store over block tables: K/V are read in place through the
// block table (no gather copy, no padding), one call covers a ragged batch of decodes and
// prefill chunks, query heads of a GQA group share each K/V row, and the softmax runs
// online in fp32. Built by kernels/cpu_extension.py with -march=native for the host CPU.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "work_pool.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int kQueryTile = 16;   // query tokens of one sequence that share each K/V read
// Keys scored before one online-softmax update, and prefetched one chunk ahead. At batch 64
// over 300-token contexts, 32 keys took ~9 % longer than 64 (more rescales, a shallower
// prefetch), and 128 lowered attention's share of the decode step from 0.31-0.33 to
// 0.30 (bench/decode_step.py, three runs each).
constexpr int kKeyChunk = 128;
// Fewest keys one KV split of a decode gets. At 256, a chat decode of a few hundred tokens
// ran its 3 KV heads unsplit on 2 threads, one thread taking two; split at 64, the six
// halves share out evenly and the step's attention took ~17 % less.
constexpr int kMinSplitKeys = 64;

using kvscope::load;
using kvscope::store;

inline float dot(const float* __restrict a, const float* __restrict b, int dim) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int d = 0; d < dim; ++d) sum += a[d] * b[d];
  return sum;
}

// Rows of a key or value chunk, widened to fp32 once and then read by every query row of
// the tile (a GQA group's heads, prefill tokens): the conversion is paid once per element.
template <typename KV>
inline void widen_rows(const KV* const* rows, int n, int dim, float* __restrict out) {
  for (int i = 0; i < n; ++i) {
    const KV* __restrict row = rows[i];
    float* __restrict dst = out + static_cast<int64_t>(i) * dim;
#pragma omp simd
    for (int d = 0; d < dim; ++d) dst[d] = load(row[d]);
  }
}

// acc += sum_i weights[i] * values[i]. With head_dim known at compile time the
// accumulator lives in registers across the keys instead of going through memory per key.
template <int kDim>
inline void accumulate_values(float* __restrict acc, const float* __restrict weights,
                              const float* __restrict values, int n, int dim) {
  if constexpr (kDim > 0) {
    float local[kDim];
#pragma omp simd
    for (int d = 0; d < kDim; ++d) local[d] = acc[d];
    for (int i = 0; i < n; ++i) {
      const float* __restrict v = values + static_cast<int64_t>(i) * kDim;
#pragma omp simd
      for (int d = 0; d < kDim; ++d) local[d] += weights[i] * v[d];
    }
#pragma omp simd
    for (int d = 0; d < kDim; ++d) acc[d] = local[d];
  } else {
    for (int i = 0; i < n; ++i) {
      const float* __restrict v = values + static_cast<int64_t>(i) * dim;
#pragma omp simd
      for (int d = 0; d < dim; ++d) acc[d] += weights[i] * v[d];
    }
  }
}

#if defined(__AVX512BF16__)
// The lane sums of 16 vectors as one vector: out[i] = sum of partial[i]'s lanes. Each level
// adds pairs of vectors after interleaving them, halving the count, so 16 scores cost 45
// shuffles and adds instead of a horizontal sum apiece.
inline __m512 sum_lanes_of_16(__m512* partial) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(partial[2 * i], partial[2 * i + 1]),
                             _mm512_unpackhi_ps(partial[2 * i], partial[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: [a, b, c, d], each that lane's share
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // lanes [v(L0+L1), v(L2+L3), w(L0+L1), w(L2+L3)]
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

// scores[i] = scale * (q . key_rows[i]) for i < n, bf16 query and keys: vdpbf16ps takes the
// keys as they lie in the cache, with no widening to fp32, 32 products per instruction; the
// products are exact and summed in fp32, like the portable path's.
template <int kDim>
inline void score_keys_bf16(const kvscope::bf16* query, const kvscope::bf16* const* key_rows,
                            int n, float scale, float* scores) {
  constexpr int kPairs = kDim / 32;
  __m512bh q[kPairs];
  for (int c = 0; c < kPairs; ++c) q[c] = (__m512bh)_mm512_loadu_si512(query + 32 * c);
  for (int first = 0; first < n; first += 16) {
    const int count = std::min(16, n - first);
    __m512 partial[16];
    for (int i = 0; i < 16; ++i) {
      partial[i] = _mm512_setzero_ps();
      if (i >= count) continue;
      for (int c = 0; c < kPairs; ++c)
        partial[i] = _mm512_dpbf16_ps(
            partial[i], q[c], (__m512bh)_mm512_loadu_si512(key_rows[first + i] + 32 * c));
    }
    _mm512_mask_storeu_ps(scores + first, static_cast<__mmask16>((1u << count) - 1u),
                          _mm512_mul_ps(sum_lanes_of_16(partial), _mm512_set1_ps(scale)));
  }
}
#endif

// One unit of work: query tokens [q_begin, q_end) of sequence `seq` (offsets within its
// query), every query head of KV head `kv_head`, over keys [k_begin, k_end).
struct WorkItem {
  int seq, kv_head, q_begin, q_end, k_begin, k_end;
  int64_t partial;  // -1: normalise into `out`; else the first row of the split buffers
};

struct Layout {
  int num_heads, num_kv_heads, group, dim, block_size;
  int64_t block_stride, slot_stride, head_stride;  // cache strides
  int64_t table_stride;
  int64_t query_stride;  // between tokens: rows may be views into a fused projection
};

// Per-thread scratch, kept between calls and grown to the largest layout seen: a decode step
// calls the op once per layer, and allocating and zeroing it each time cost a sizeable part
// of a short sequence's attention. run_item writes every element before reading it.
struct Scratch {
  std::vector<float> q, acc, row_max, row_sum, keys, values, scores;
  void fit(const Layout& L) {
    auto at_least = [](std::vector<float>& buffer, int64_t size) {
      if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
    };
    at_least(q, static_cast<int64_t>(kQueryTile) * L.group * L.dim);
    at_least(acc, q.size());
    at_least(row_max, static_cast<int64_t>(kQueryTile) * L.group);
    at_least(row_sum, row_max.size());
    at_least(keys, static_cast<int64_t>(kKeyChunk) * L.dim);
    at_least(values, keys.size());
    at_least(scores, kKeyChunk);
  }
};

Scratch& thread_scratch(const Layout& L) {
  thread_local Scratch scratch;
  scratch.fit(L);
  return scratch;
}

// kDim > 0 fixes head_dim at compile time (64 and 128, the common sizes), so the per-key
// dot products and updates unroll into straight vector code; 0 reads it from the layout.
template <typename Q, typename KV, int kDim>
void run_item(const WorkItem& item, const Layout& L, const Q* query, const KV* key_cache,
              const KV* value_cache, const int32_t* tables, const int32_t* seq_lens,
              const int32_t* starts, float scale, Q* out, float* part_acc, float* part_max,
              float* part_sum, Scratch& scratch) {
#if defined(__AVX512BF16__)
  constexpr bool kPairDots = std::is_same_v<Q, kvscope::bf16> &&
                             std::is_same_v<KV, kvscope::bf16> && kDim > 0 && kDim % 32 == 0;
#else
  constexpr bool kPairDots = false;
#endif
  const int G = L.group, D = kDim > 0 ? kDim : L.dim;
  const int start = starts[item.seq];
  const int query_len = starts[item.seq + 1] - start;
  const int context = seq_lens[item.seq] - query_len;  // keys before the first new token
  const int num_q = (item.q_end - item.q_begin) * G;
  float* q = scratch.q.data();
  float* acc = scratch.acc.data();
  float* row_max = scratch.row_max.data();
  float* row_sum = scratch.row_sum.data();
  std::fill_n(acc, static_cast<int64_t>(num_q) * D, 0.f);
  std::fill_n(row_max, num_q, -std::numeric_limits<float>::infinity());
  std::fill_n(row_sum, num_q, 0.f);
  // The query row j of this item: token q_begin + j / G, head kv_head * G + j % G.
  auto query_row = [&](int j) {
    const int t = item.q_begin + j / G, head = item.kv_head * G + j % G;
    return query + static_cast<int64_t>(start + t) * L.query_stride + head * D;
  };
  if constexpr (!kPairDots)  // the portable path scores against scaled fp32 rows
    for (int j = 0; j < num_q; ++j)
      for (int d = 0; d < D; ++d) q[static_cast<int64_t>(j) * D + d] = load(query_row(j)[d]) * scale;
  // The last query token sees keys up to its own position.
  const int k_end = std::min(item.k_end, context + item.q_end);
  const int32_t* table = tables + static_cast<int64_t>(item.seq) * L.table_stride;
  const KV* key_rows[kKeyChunk];
  const KV* value_rows[kKeyChunk];
  float* keys = scratch.keys.data();
  float* values = scratch.values.data();
  float* scores = scratch.scores.data();
  auto slot_offset = [&](int pos) {
    return static_cast<int64_t>(table[pos / L.block_size]) * L.block_stride +
           (pos % L.block_size) * L.slot_stride + item.kv_head * L.head_stride;
  };
  // Ask for the next chunk's rows while this one is computed: they sit in blocks anywhere
  // in the pool, a pattern the hardware prefetcher cannot follow.
  const int64_t row_bytes = static_cast<int64_t>(D) * sizeof(KV);
  auto prefetch_chunk = [&](int chunk) {
    for (int pos = chunk; pos < std::min(chunk + kKeyChunk, k_end); ++pos) {
      const int64_t offset = slot_offset(pos);
      for (int64_t line = 0; line < row_bytes; line += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(key_cache + offset) + line);
        __builtin_prefetch(reinterpret_cast<const char*>(value_cache + offset) + line);
      }
    }
  };
  for (int chunk = item.k_begin; chunk < k_end; chunk += kKeyChunk) {
    const int n = std::min(kKeyChunk, k_end - chunk);
    for (int i = 0; i < n; ++i) {
      const int64_t offset = slot_offset(chunk + i);
      key_rows[i] = key_cache + offset;
      value_rows[i] = value_cache + offset;
    }
    prefetch_chunk(chunk + kKeyChunk);
    if constexpr (!kPairDots) widen_rows(key_rows, n, D, keys);
    widen_rows(value_rows, n, D, values);
    for (int j = 0; j < num_q; ++j) {
      const int visible = context + item.q_begin + j / G + 1;  // keys [0, visible)
      const int m = std::min(n, visible - chunk);
      if (m <= 0) continue;
#if defined(__AVX512BF16__)
      if constexpr (kPairDots) {
        score_keys_bf16<kDim>(query_row(j), key_rows, m, scale, scores);
      }
#endif
      if constexpr (!kPairDots) {
        const float* qj = q + static_cast<int64_t>(j) * D;
        for (int i = 0; i < m; ++i) scores[i] = dot(qj, keys + static_cast<int64_t>(i) * D, D);
      }
      float chunk_max = row_max[j];
#pragma omp simd reduction(max : chunk_max)
      for (int i = 0; i < m; ++i) chunk_max = std::max(chunk_max, scores[i]);
      float* accj = acc + static_cast<int64_t>(j) * D;
      if (chunk_max > row_max[j]) {
        const float correction = std::exp(row_max[j] - chunk_max);  // 0 for the first chunk
        row_sum[j] *= correction;
#pragma omp simd
        for (int d = 0; d < D; ++d) accj[d] *= correction;
        row_max[j] = chunk_max;
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int i = 0; i < m; ++i) {
        scores[i] = kvscope::exp_nonpositive(scores[i] - chunk_max);
        sum += scores[i];
      }
      row_sum[j] += sum;
      accumulate_values<kDim>(accj, scores, values, m, D);
    }
  }
  for (int j = 0; j < num_q; ++j) {
    const float* accj = acc + static_cast<int64_t>(j) * D;
    if (item.partial < 0) {
      const int t = item.q_begin + j / G, head = item.kv_head * G + j % G;
      Q* dst = out + (static_cast<int64_t>(start + t) * L.num_heads + head) * D;
      const float inverse = row_sum[j] > 0.f ? 1.f / row_sum[j] : 0.f;
      for (int d = 0; d < D; ++d) store(dst[d], accj[d] * inverse);
    } else {
      const int64_t row = item.partial + j;
      part_max[row] = row_max[j];
      part_sum[row] = row_sum[j];
      std::memcpy(part_acc + row * D, accj, sizeof(float) * D);
    }
  }
}

// Several KV splits of one decode (sequence, KV head) merged by their softmax statistics.
struct SplitGroup {
  int seq, kv_head, num_splits;
  int64_t first_row;  // split s, query head g: row first_row + s * group + g
};

template <typename Q, typename KV>
void attention(const at::Tensor& query, const at::Tensor& key_cache,
               const at::Tensor& value_cache, const at::Tensor& block_tables,
               const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
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
  const int num_seqs = seq_lens.size(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();

  // Few long decodes leave threads idle: split their keys so every thread has work.
  const int threads = at::get_num_threads();
  int64_t base_items = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int query_len = starts[s + 1] - starts[s];
    base_items += static_cast<int64_t>(L.num_kv_heads) * ((query_len + kQueryTile - 1) / kQueryTile);
  }
  const int64_t wanted_items = 2 * static_cast<int64_t>(threads);
  std::vector<WorkItem> items;
  std::vector<SplitGroup> groups;
  int64_t partial_rows = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int query_len = starts[s + 1] - starts[s];
    if (query_len <= 0) continue;
    const int seq_len = lens[s];
    int splits = 1;
    if (query_len == 1 && base_items < wanted_items && base_items > 0) {
      const int64_t by_work = (wanted_items + base_items - 1) / base_items;
      splits = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(by_work, seq_len / kMinSplitKeys)));
    }
    for (int h = 0; h < L.num_kv_heads; ++h) {
      if (splits == 1) {
        for (int t = 0; t < query_len; t += kQueryTile)
          items.push_back({s, h, t, std::min(query_len, t + kQueryTile), 0, seq_len, -1});
        continue;
      }
      groups.push_back({s, h, splits, partial_rows});
      const int per_split = (seq_len + splits - 1) / splits;
      for (int split = 0; split < splits; ++split) {
        const int k_begin = split * per_split;
        items.push_back({s, h, 0, 1, k_begin, std::min(seq_len, k_begin + per_split),
                         partial_rows + static_cast<int64_t>(split) * L.group});
      }
      partial_rows += static_cast<int64_t>(splits) * L.group;
    }
  }
  std::vector<float> part_acc(partial_rows * L.dim), part_max(partial_rows), part_sum(partial_rows);
  const Q* q = kvscope::elements<Q>(query);
  const KV* k = kvscope::elements<KV>(key_cache);
  const KV* v = kvscope::elements<KV>(value_cache);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  Q* o = kvscope::elements<Q>(out);
  auto run_items = [&](auto run) {
    kvscope::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      Scratch& scratch = thread_scratch(L);
      for (int64_t i = begin; i < end; ++i)
        run(items[i], L, q, k, v, tables, lens, starts, static_cast<float>(scale), o,
            part_acc.data(), part_max.data(), part_sum.data(), scratch);
    });
  };
  if (L.dim == 64)
    run_items(run_item<Q, KV, 64>);
  else if (L.dim == 128)
    run_items(run_item<Q, KV, 128>);
  else
    run_items(run_item<Q, KV, 0>);
  for (const SplitGroup& group : groups) {
    for (int g = 0; g < L.group; ++g) {
      float merged_max = -std::numeric_limits<float>::infinity();
      for (int split = 0; split < group.num_splits; ++split)
        merged_max = std::max(merged_max, part_max[group.first_row + split * L.group + g]);
      std::vector<float> acc(L.dim, 0.f);
      float total = 0.f;
      for (int split = 0; split < group.num_splits; ++split) {
        const int64_t row = group.first_row + split * L.group + g;
        if (part_sum[row] == 0.f) continue;
        const float weight = std::exp(part_max[row] - merged_max);
        total += part_sum[row] * weight;
        for (int d = 0; d < L.dim; ++d) acc[d] += part_acc[row * L.dim + d] * weight;
      }
      Q* dst = o + (static_cast<int64_t>(starts[group.seq]) * L.num_heads + group.kv_head * L.group + g) * L.dim;
      for (int d = 0; d < L.dim; ++d) store(dst[d], acc[d] / total);
    }
  }
}

void check_inputs(const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                  const at::Tensor& out) {
  TORCH_CHECK(query.device().is_cpu(), "paged_attention_cpu: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [tokens, heads, dim], cache [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.is_contiguous(),
              "query rows [heads, dim] must be contiguous, out contiguous");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(), "out must match query");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.strides() == value_cache.strides(), "key and value caches must share a layout");
  TORCH_CHECK(key_cache.stride(3) == 1, "cache rows must be contiguous in head_dim");
  TORCH_CHECK(key_cache.size(3) == query.size(2), "head_dim of query and cache differ");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2, "block_tables: contiguous int32 [seqs, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens: contiguous int32");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous() && query_start_loc.numel() == seq_lens.numel() + 1, "query_start_loc: contiguous int32 [seqs + 1]");
}

}  // namespace

// out[t, h] = softmax(q[t, h] . K) V over each sequence's paged keys up to t's position.
void paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     double scale, at::Tensor out) {
  check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out);
  if (query.size(0) == 0) return;
  const auto q_type = query.scalar_type(), kv_type = key_cache.scalar_type();
  if (q_type == at::kFloat && kv_type == at::kFloat)
    attention<float, float>(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out);
  else if (q_type == at::kBFloat16 && kv_type == at::kBFloat16)
    attention<kvscope::bf16, kvscope::bf16>(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out);
  else if (q_type == at::kFloat && kv_type == at::kBFloat16)
    attention<float, kvscope::bf16>(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out);
  else
    TORCH_CHECK(false, "paged_attention_cpu: unsupported query/cache dtypes ", q_type, "/", kv_type);
}

// Copy each token's K/V rows [kv_heads, dim] into its slot; slot -1 is skipped.
void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
              at::Tensor value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type(), "store_kv_cpu: K/V must have the cache's dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key_cache.stride(3) == 1, "store_kv_cpu: rows must be contiguous in head_dim");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping: contiguous int64");
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
    const int64_t base = (slot / block_size) * key_cache.stride(0) + (slot % block_size) * key_cache.stride(1);
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(kc + (base + h * key_cache.stride(2)) * e, k + (t * key.stride(0) + h * key.stride(1)) * e, bytes);
      std::memcpy(vc + (base + h * value_cache.stride(2)) * e, v + (t * value.stride(0) + h * value.stride(1)) * e, bytes);
    }
  }
}

TORCH_LIBRARY(kvscope, m) {
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, float scale, Tensor(a!) out) -> ()");
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("store_kv", &store_kv);
}
