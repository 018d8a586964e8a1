// CPU paged attention and KV store over block tables: K/V are read in place through the
// block table (no gather copy, no padding), one call covers a ragged batch of decodes and
// prefill chunks, query heads of a GQA group share each K/V row, and the softmax runs
// online in fp32. A quantized cache (quantized.h) is read the same way. Built by
// kernels/cpu_extension.py with -march=native for the host CPU.
//
// This file holds the entry points: the checks, the dtype dispatch, the cut of a batch into
// work items over the threads and the merge of a decode's KV splits. The items run in
// decode.h (a query row at a time) or prefill_tiles.h (long prefill chunks as matrix
// products), over what common.h defines for both.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention/common.h"
#include "attention/decode.h"
#include "attention/quantized.h"
#include "cpu_common.h"
#include "cpu_ops.h"
#include "work_pool.h"

namespace kvscope::attention {
namespace {

constexpr int kQueryTile = 16;  // query tokens of one sequence that share each K/V read
// Query rows (tokens times a GQA group's heads) of a prefill tile that runs as matrix products
// (run_prefill_tile): it lays its keys and values out for them once per chunk, so more rows
// share that work. 128: a 2,048-token prefill at Qwen3's heads faster than with 32 rows, and the
// tile's sums (~200 KB) stay in L2 (docs/performance-history.md, "A prefill's attention on AMX
// tiles").
constexpr int kTileQueryRows = 128;
// A decode's KV split is a multiple of this many keys, so the tokens of a verification chunk,
// whose key counts differ by a few, mostly split alike.
constexpr int kSplitAlign = 16;
// Fewest keys one KV split of a decode gets: a chat decode of a few hundred tokens still
// splits, so both threads share its attention.
constexpr int kMinSplitKeys = 64;

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

// The block-table entries sequence `seq` reads, from its first query token's window to its
// last key, must each name a block of the cache: an entry the KV manager released too early
// (-1) or garbage would otherwise be read as an address. Checked once per sequence while the
// calling thread plans the work, so the ValueError is raised there, before any worker reads
// the table (and not once per key block read).
void check_table(const Layout& L, const int32_t* tables, int64_t num_blocks, int seq, int context,
                 int seq_len) {
  const int first = L.first_visible(context) / L.block_size, last = (seq_len - 1) / L.block_size;
  TORCH_CHECK_VALUE(last < L.table_stride, "paged_attention_cpu: block_tables: sequence ", seq,
                    " has ", seq_len, " keys, which need ", last + 1, " entries, but its row has ",
                    L.table_stride);
  const int32_t* table = tables + static_cast<int64_t>(seq) * L.table_stride;
  for (int block = first; block <= last; ++block)
    TORCH_CHECK_VALUE(table[block] >= 0 && table[block] < num_blocks,
                      "paged_attention_cpu: block_tables[", seq, "][", block, "] = ", table[block],
                      ", outside the cache's blocks [0, ", num_blocks, "), but sequence ", seq,
                      " reads it (its queries see keys ", L.first_visible(context), "..",
                      seq_len - 1, ")");
}

template <typename Q, typename KV>
void attend(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens,
            const at::Tensor& query_start_loc, double scale, int64_t window, double soft_cap,
            const std::optional<at::Tensor>& sinks, at::Tensor& out) {
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
  L.sinks = sinks ? sinks->data_ptr<float>() : nullptr;
  const bool tiles =
      with_head_dim(L.dim, [](auto dim) { return kPairDots<Q, KV, decltype(dim)::value>; });
  L.tile_tokens = tiles ? std::max(kQueryTile, kTileQueryRows / L.group) : kQueryTile;
  const int num_seqs = seq_lens.size(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();

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
    check_table(L, tables, key_cache.size(0), s, context, seq_len);
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
      const int head = group.first.head_of(j, L.group);
      total = softmax_denominator(L, head, merged_max, total);
      Q* dst = o + (token * L.num_heads + head) * L.dim;
      for (int d = 0; d < L.dim; ++d) store(dst[d], acc[d] / total);
    }
  }
}

void check_inputs(const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                  const std::optional<at::Tensor>& sinks, const at::Tensor& out) {
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
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                         sinks->dim() == 1 && sinks->size(0) == query.size(1)),
              "sinks: contiguous fp32 [heads]");
}

}  // namespace
}  // namespace kvscope::attention

using namespace kvscope::attention;

// out[t, h] = softmax(q[t, h] . K) V over each sequence's paged keys up to t's position (the
// last `window` of them when window > 0; table entries before those are never read), the
// scores soft-capped when soft_cap > 0, head h's sinks[h] in its softmax's denominator when
// sinks are given.
void paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                     at::Tensor out, int64_t window, double soft_cap,
                     const std::optional<at::Tensor>& sinks) {
  check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, sinks, out);
  TORCH_CHECK(window >= 0 && soft_cap >= 0,
              "paged_attention_cpu: window and soft_cap must be >= 0");
  if (query.size(0) == 0) return;
  const auto q_type = query.scalar_type(), kv_type = key_cache.scalar_type();
  if (q_type == at::kFloat && kv_type == at::kFloat)
    attend<float, float>(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                         scale, window, soft_cap, sinks, out);
  else if (q_type == at::kBFloat16 && kv_type == at::kBFloat16)
    attend<kvscope::bf16, kvscope::bf16>(query, key_cache, value_cache, block_tables, seq_lens,
                                         query_start_loc, scale, window, soft_cap, sinks, out);
  else if (q_type == at::kFloat && kv_type == at::kBFloat16)
    attend<float, kvscope::bf16>(query, key_cache, value_cache, block_tables, seq_lens,
                                 query_start_loc, scale, window, soft_cap, sinks, out);
  else if ((q_type == at::kFloat || q_type == at::kBFloat16) && quantized_kv(kv_type))
    with_quantized(q_type, kv_type, [&](auto q_element, auto kv_element) {
      attend<decltype(q_element), decltype(kv_element)>(query, key_cache, value_cache, block_tables,
                                                        seq_lens, query_start_loc, scale, window,
                                                        soft_cap, sinks, out);
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
