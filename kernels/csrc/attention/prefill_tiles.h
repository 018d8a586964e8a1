// Paged attention's long prefill chunks as tiles: a bf16 query over a bf16 or quantized cache
// (kPairDots), the rows of up to L.tile_tokens tokens at one KV head, as two small matrix
// products per key chunk, on AMX tiles where the process may use them, else on bf16 pair
// dots. run_item's row-at-a-time scoring (decode.h) ends every key's dot in a horizontal sum,
// and its value pass multiplies in fp32, at half the pair dots' rate; a long prompt's
// attention is compute-bound and grows with its square, so a 2,000-token prefill spent half
// its time there. P, the softmax weights, is rounded to bf16 (as torch's CPU flash attention
// rounds it) by the softmax between the products (softmax_to_bf16, row by row).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "amx.h"
#include "attention/common.h"
#include "attention/quantized.h"
#include "cpu_common.h"
#include "vec.hpp"

namespace kvscope::attention {

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

// A prefill tile: up to L.tile_tokens tokens of one sequence, the G query heads of one KV head
// each.
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

}  // namespace kvscope::attention
