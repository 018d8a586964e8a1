// The dense linear of a decode batch's rows (linear_small_batch): every weight row is read
// from memory once, streamed, and dotted with all rows of x while it sits in L1. Weights
// prepacked in tiles (linear_blocked) stream the same way for a decode batch and serve a
// prefill's rows too; oneDNN's AMX tiles stream through AMX itself (amx_linear), and its GEMM
// takes a prefill's rows (linear_onednn).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/from_blob.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "cpu_common.h"
#include "cpu_ops.h"
#include "vec.hpp"
#include "work_pool.h"

namespace {

using kvscope::load;
using kvscope::round_to;
using kvscope::store;

// Rows of x that meet each weight chunk together, their sums in registers: widened to fp32
// (two sums a row), or as bf16 pairs (four sums a row: two per weight row).
constexpr int kRowGroup = 8;
constexpr int kBf16RowGroup = 4;

#if defined(__AVX512BF16__)
// Rows bf16 rows of x . bf16 weight rows w0 and w1 with vdpbf16ps: one instruction multiplies
// 32 pairs and adds them into 16 fp32 sums, so the weights need no widening to fp32 first.
// Each chunk of the two weight rows is loaded once for all Rows rows. The products are exact
// in fp32, as in vec::dot_rows; only the order of the fp32 sums differs, and it is the same
// for a row whatever Rows is.
template <int Rows>
void dot_two_rows_bf16(const kvscope::bf16* __restrict x, int64_t x_stride,
                       const kvscope::bf16* __restrict w0, const kvscope::bf16* __restrict w1,
                       int64_t size, float* __restrict sums0, float* __restrict sums1) {
  using kvscope::vec::BF16Vec32;
  using kvscope::vec::dot_accumulate;
  using kvscope::vec::FP32Vec16;
  FP32Vec16 first[Rows][2], second[Rows][2];
  for (int m = 0; m < Rows; ++m)
    first[m][0] = first[m][1] = second[m][0] = second[m][1] = FP32Vec16(0.f);
  // The chunk of 32 at k into accumulator `part` of every row; `load` reads 32 values at a
  // pointer (all of them, or the tail's first few).
  auto chunk = [&](int64_t k, int part, auto load) {
    const BF16Vec32 a = load(w0 + k), b = load(w1 + k);
    for (int m = 0; m < Rows; ++m) {
      const BF16Vec32 xs = load(x + m * x_stride + k);
      first[m][part] = dot_accumulate(first[m][part], xs, a);
      second[m][part] = dot_accumulate(second[m][part], xs, b);
    }
  };
  auto whole = [](const kvscope::bf16* p) { return BF16Vec32::load(p); };
  int64_t k = 0;
  for (; k + 64 <= size; k += 64) {
    chunk(k, 0, whole);
    chunk(k + 32, 1, whole);
  }
  if (k + 32 <= size) {
    chunk(k, 0, whole);
    k += 32;
  }
  if (k < size)  // the last < 32 elements, the rest of the vector zero
    chunk(k, 1,
          [count = size - k](const kvscope::bf16* p) { return BF16Vec32::load_first(p, count); });
  for (int m = 0; m < Rows; ++m) {
    sums0[m] = (first[m][0] + first[m][1]).reduce_sum();
    sums1[m] = (second[m][0] + second[m][1]).reduce_sum();
  }
}
#endif

// Out is T, or fp32 for bf16 T (logits): each value is rounded to T first either way, so an
// fp32 out holds exactly what converting the T result would give, without a pass for it.
template <typename T, typename Out>
void small_batch_linear(const T* x, int64_t x_stride, const T* weight, const T* bias, Out* out,
                        int64_t out_stride, int64_t rows, int64_t in_features,
                        int64_t out_features) {
  if (rows == 0) return;
  // dot_pair(w0, w1, sums0, sums1): every row of x . weight rows w0 and w1. A thread's share
  // of the outputs is read as two streams, from its first half and its second half side by side:
  // two streams keep more reads in flight than one (docs/performance-history.md, 'Dense linear of a
  // few rows'). An odd last row pairs with itself. One share per thread: each share starts its two
  // streams anew, so more, smaller shares would start more cold streams. A helper that has not
  // started leaves its share to the caller.
  auto each_output = [&](auto dot_pair) {
    kvscope::parallel_for(0, out_features,
                          std::max<int64_t>(64, kvscope::one_share_per_thread(out_features)),
                          [&](int64_t begin, int64_t end) {
      const int64_t half = (end - begin) / 2;
      std::vector<float> buffer(2 * rows);
      float* sums[2] = {buffer.data(), buffer.data() + rows};
      auto write = [&](int64_t n, const float* row_sums) {
        const float shift = bias != nullptr ? load(bias[n]) : 0.f;
        for (int64_t m = 0; m < rows; ++m)
          store(out[m * out_stride + n], round_to(row_sums[m] + shift, static_cast<T*>(nullptr)));
      };
      for (int64_t i = 0; i < half; ++i) {
        const int64_t n0 = begin + i, n1 = begin + half + i;
        dot_pair(weight + n0 * in_features, weight + n1 * in_features, sums[0], sums[1]);
        write(n0, sums[0]);
        write(n1, sums[1]);
      }
      if ((end - begin) % 2 != 0) {
        const T* last = weight + (end - 1) * in_features;
        dot_pair(last, last, sums[0], sums[1]);
        write(end - 1, sums[0]);
      }
    });
  };
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, kvscope::bf16>) {
    each_output([&](const T* w0, const T* w1, float* sums0, float* sums1) {
      kvscope::by_row_groups<kBf16RowGroup>(rows, [&](auto count, int64_t first) {
        dot_two_rows_bf16<decltype(count)::value>(x + first * x_stride, x_stride, w0, w1,
                                                  in_features, sums0 + first, sums1 + first);
      });
    });
    return;
  }
#endif
  std::vector<float> xf(rows * in_features);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t k = 0; k < in_features; ++k) xf[m * in_features + k] = load(x[m * x_stride + k]);
  each_output([&](const T* w0, const T* w1, float* sums0, float* sums1) {
    kvscope::by_row_groups<kRowGroup>(rows, [&](auto count, int64_t first) {
      constexpr int Rows = decltype(count)::value;
      const float* group = xf.data() + first * in_features;
      kvscope::vec::dot_rows<Rows>(group, in_features, w0, in_features, sums0 + first);
      kvscope::vec::dot_rows<Rows>(group, in_features, w1, in_features, sums1 + first);
    });
  });
}

// A tiled bf16 weight [out, in] is oneDNN's layout "AB16b<T>a2b": tiles of T outputs x 32
// inputs, tile (o / T, i / 32) at element ((o / T) * (in / 32) + i / 32) * T * 32, and inside a
// tile 16 input pairs x T outputs x the pair: each input pair's row is a row of an AMX B tile
// (T = 32: oneDNN's own, where the CPU has AMX) or T / 16 vectors of vdpbf16ps operands
// (T = 64: oneDNN's choice without AMX, which kvscope lays out itself). A column of tiles
// (T outputs, all inputs) is contiguous. The blocks come as [out / T, T * in], so their shape
// says T. kernels/cpu_kernels.py's prepack_weight makes them (reference.plain_to_blocked).
constexpr int64_t kTileInputs = 32;

// Rows per pass over a tile column: their four sums a row stay in registers.
constexpr int kBlockedRowGroup = 5;
// Past this many rows the threads share out rows instead of columns, and each takes its rows
// this many at a time (blocked_linear).
constexpr int64_t kBlockedRowBlock = 128;

// Rows (<= kBlockedRowGroup, a constant: the sums then stay in registers) rows of x (row stride
// x_stride) times `Columns` tile columns of T outputs (all inputs), into
// sums[column][row][part] (outputs 16 part .. 16 part + 15); blocked_linear says how many
// columns. Each output sums its input pairs in input order, so a row's result does not
// depend on the other rows.
template <int T, int Rows, int Columns>
void tile_columns(const kvscope::bf16* x, int64_t x_stride,
                  const kvscope::bf16* const (&columns)[Columns], int64_t in_features,
                  kvscope::vec::FP32Vec16 (&sums)[Columns][Rows][T / 16]) {
#if defined(__AVX512BF16__)
  using kvscope::vec::BF16Vec32;
  using kvscope::vec::dot_accumulate;
  using kvscope::vec::FP32Vec16;
  constexpr int kParts = T / 16;
  FP32Vec16 local[Columns][Rows][kParts];
  for (auto& column : local)
    for (auto& row : column)
      for (auto& part : row) part = FP32Vec16(0.f);
  for (int64_t start = 0; start < in_features; start += kTileInputs)
    for (int64_t pair = 0; pair < kTileInputs / 2; ++pair) {
      const int64_t offset = start / kTileInputs * T * kTileInputs + pair * 2 * T;
      BF16Vec32 weights[Columns][kParts];
      for (int c = 0; c < Columns; ++c)
        for (int part = 0; part < kParts; ++part)
          weights[c][part] = BF16Vec32::load(columns[c] + offset + part * 32);
      for (int m = 0; m < Rows; ++m) {
        const BF16Vec32 xs = BF16Vec32::broadcast_pair(x + m * x_stride + start + 2 * pair);
        for (int c = 0; c < Columns; ++c)
          for (int part = 0; part < kParts; ++part)
            local[c][m][part] = dot_accumulate(local[c][m][part], xs, weights[c][part]);
      }
    }
  for (int c = 0; c < Columns; ++c)
    for (int m = 0; m < Rows; ++m)
      for (int part = 0; part < kParts; ++part) sums[c][m][part] = local[c][m][part];
#else
  TORCH_CHECK(false, "linear_blocked: built without AVX512-BF16");
#endif
}

// Writes 16 outputs of a row at a time, bias added, into bf16 out or (the logits) fp32 out
// holding the bf16 result widened. Lane by lane, the rounding and stores cost as much as the
// products of a 576-input column (docs/performance-history.md, "oneDNN's 64-output tiles").
class SumsWriter {
 public:
  SumsWriter(const kvscope::bf16* bias, at::Tensor& out)
      : bias_(bias),
        fp32_(out.scalar_type() == at::kFloat ? kvscope::elements<float>(out) : nullptr),
        bf16_(fp32_ ? nullptr : kvscope::elements<kvscope::bf16>(out)),
        width_(out.size(1)) {}

  void write(int64_t row, int64_t first_output, kvscope::vec::FP32Vec16 sums) const {
    const int64_t at = row * width_ + first_output;
    if (bias_ != nullptr) sums += kvscope::vec::FP32Vec16::load(bias_ + first_output);
    if (fp32_ != nullptr)
      sums.rounded_to(static_cast<kvscope::bf16*>(nullptr)).store(fp32_ + at);
    else
      sums.store(bf16_ + at);
  }

 private:
  const kvscope::bf16* bias_;
  float* fp32_;
  kvscope::bf16* bf16_;
  int64_t width_;
};

// linear_blocked for tiles of T outputs, C tile columns per tile_columns call:
// two from two places (two weight streams in flight, as small_batch_linear's two halves)
// where their sums fit in registers beside the weights, else one. Each column (or pair)
// meets every group of kBlockedRowGroup rows while it is in cache.
template <int T, int C>
void blocked_linear(const kvscope::bf16* xs, int64_t x_stride, int64_t rows,
                    const kvscope::bf16* weight, const kvscope::bf16* bias_values,
                    int64_t in_features, int64_t out_features, at::Tensor& out) {
  constexpr int kParts = T / 16;
  const int64_t column_elements = T * in_features;
  const SumsWriter writer(bias_values, out);
  auto write = [&](int64_t column, int64_t m, const kvscope::vec::FP32Vec16(&sums)[kParts]) {
    for (int part = 0; part < kParts; ++part) writer.write(m, column * T + part * 16, sums[part]);
  };
  // The columns at `starts`, of which the first `count` are written, times rows
  // [row_begin, row_end).
  auto run = [&](const int64_t (&starts)[C], int count, int64_t row_begin, int64_t row_end) {
    const kvscope::bf16* columns[C];
    for (int c = 0; c < C; ++c) columns[c] = weight + starts[c] * column_elements;
    kvscope::by_row_groups<kBlockedRowGroup>(row_end - row_begin, [&](auto group, int64_t offset) {
      constexpr int R = decltype(group)::value;
      const int64_t first = row_begin + offset;
      kvscope::vec::FP32Vec16 sums[C][R][kParts];
      tile_columns<T, R, C>(xs + first * x_stride, x_stride, columns, in_features, sums);
      for (int c = 0; c < count; ++c)
        for (int m = 0; m < R; ++m) write(starts[c], first + m, sums[c][m]);
    });
  };
  // Columns [begin, end) times rows [row_begin, row_end), C columns at a time from C places
  // spread over the range (C weight streams in flight); the columns left over one by one.
  auto columns_times_rows = [&](int64_t begin, int64_t end, int64_t row_begin, int64_t row_end) {
    const int64_t stride = (end - begin) / C;
    int64_t starts[C];
    for (int64_t i = 0; i < stride; ++i) {
      for (int c = 0; c < C; ++c) starts[c] = begin + c * stride + i;
      run(starts, C, row_begin, row_end);
    }
    for (int64_t i = begin + C * stride; i < end; ++i) {
      std::fill_n(starts, C, i);
      run(starts, 1, row_begin, row_end);
    }
  };
  const int64_t columns = out_features / T;
  if (rows > kBlockedRowBlock) {
    // A prefill's rows are shared out between the threads, and each thread takes its rows a
    // block at a time past all the columns: the block's rows and outputs stay in L2 while the
    // columns pass. Shared out by columns, a layer of 9 columns left one of two threads idle
    // a tenth of the time, and every column fetched all rows from L3 again.
    kvscope::parallel_for(0, rows, kvscope::one_share_per_thread(rows),
                          [&](int64_t begin, int64_t end) {
      for (int64_t block = begin; block < end; block += kBlockedRowBlock)
        columns_times_rows(0, columns, block, std::min(end, block + kBlockedRowBlock));
    });
    return;
  }
  // A decode batch's rows all meet each column, and the columns are shared out: every
  // weight is read from memory once.
  kvscope::parallel_for(
      0, columns, std::max<int64_t>(C, kvscope::one_share_per_thread(columns)),
      [&](int64_t begin, int64_t end) { columns_times_rows(begin, end, 0, rows); });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// On AMX, tdpbf16ps multiplies a tile of 16 rows x 32 inputs of x by a tile of 16 input pairs
// x 16 outputs of the weight (a row of oneDNN's 32-output tiles is two such rows side by side)
// into 16 x 16 fp32 sums: 16 times a vdpbf16ps's products. So a decode batch's linear reads
// its weights at the memory's speed up to 16 rows and stays ahead of oneDNN's GEMM to 32-64
// (llama_stack.cpp's kAmxTileKernelMaxRows), where the vdpbf16ps kernel is compute-bound past
// a few rows and oneDNN's GEMM reads weights from memory at about half the bandwidth
// (docs/performance-history.md, 'Decode batches through AMX itself'). Each output sums its inputs
// 32 at a time in input order whatever the other rows, so a row's result does not depend on the
// batch.
constexpr int64_t kAmxRowBlock = kvscope::amx::kTileRows;  // rows of an x tile
// How far ahead of its tiles a column's weights are asked into L2 (bytes). This and x laid
// out as tiles (amx_linear), made together, took one row's weight reads from well under the
// bandwidth to about all of it (docs/performance-history.md, 'Decode batches through AMX itself').
constexpr int64_t kAmxPrefetchAhead = 16 * 1024;

// sums [Blocks * 16 rows][32 outputs] = Blocks blocks of 16 rows of x, laid out as x tiles
// (x_tiles below), times one column of 32-output tiles. Tiles 0-3 hold the sums of row block
// b and outputs 16 h .. 16 h + 15 in tile 2 b + h; tiles 4 and 5 the two row blocks of x;
// tiles 6 and 7 the two 16-output halves of a weight tile (all shaped by
// amx::configure_tiles).
template <int Blocks>
void amx_column(const kvscope::bf16* x, int64_t in_features, const kvscope::bf16* column,
                float* sums) {
  constexpr int64_t kWeightRowBytes = 32 * 2 * sizeof(kvscope::bf16);  // one input pair's row
  constexpr int64_t kXRowBytes = kTileInputs * sizeof(kvscope::bf16);
  constexpr int64_t kTileElements = kAmxRowBlock * kTileInputs;
  const int64_t block_elements = in_features * kAmxRowBlock;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (Blocks == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t start = 0; start < in_features; start += kTileInputs) {
    const kvscope::bf16* tile = column + start * 32;
    for (int64_t line = 0; line < 32 * kTileInputs * 2; line += 64)
      kvscope::prefetch_to_l2(reinterpret_cast<const char*>(tile) + kAmxPrefetchAhead + line);
    const kvscope::bf16* x_tile = x + start / kTileInputs * kTileElements;
    _tile_loadd(6, tile, kWeightRowBytes);
    _tile_loadd(7, tile + 32, kWeightRowBytes);
    _tile_loadd(4, x_tile, kXRowBytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (Blocks == 2) {
      _tile_loadd(5, x_tile + block_elements, kXRowBytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t kSumRowBytes = 32 * sizeof(float);
  _tile_stored(0, sums, kSumRowBytes);
  _tile_stored(1, sums + 16, kSumRowBytes);
  if constexpr (Blocks == 2) {
    _tile_stored(2, sums + kAmxRowBlock * 32, kSumRowBytes);
    _tile_stored(3, sums + kAmxRowBlock * 32 + 16, kSumRowBytes);
  }
}

// linear_blocked over oneDNN's 32-output tiles on AMX. The columns are shared out between
// the threads, as a decode batch's in blocked_linear; each column meets the rows 32 at a time
// (two x tiles) while it is in L2.
void amx_linear(const kvscope::bf16* xs, int64_t x_stride, int64_t rows,
                const kvscope::bf16* weight, const kvscope::bf16* bias_values, int64_t in_features,
                int64_t out_features, at::Tensor& out) {
  // x as tiles: each block of 16 rows (zeros past `rows`: a tile load reads 16) as its
  // 32-input tiles one after another, 1 KB each. Loaded from x's rows in place, a tile's rows
  // lay a multiple of 4 KB apart and fell into one set of L1.
  const int64_t padded = (rows + kAmxRowBlock - 1) / kAmxRowBlock * kAmxRowBlock;
  thread_local std::vector<kvscope::bf16> x_tiles;
  x_tiles.resize(padded * in_features);
  for (int64_t m = 0; m < padded; ++m) {
    kvscope::bf16* row = x_tiles.data() + m / kAmxRowBlock * kAmxRowBlock * in_features +
                         m % kAmxRowBlock * kTileInputs;
    for (int64_t start = 0; start < in_features; start += kTileInputs) {
      kvscope::bf16* tile_row = row + start * kAmxRowBlock;
      if (m < rows)
        std::copy_n(xs + m * x_stride + start, kTileInputs, tile_row);
      else
        std::fill_n(tile_row, kTileInputs, kvscope::bf16{0});
    }
  }
  const kvscope::bf16* x = x_tiles.data();
  const SumsWriter writer(bias_values, out);
  const int64_t columns = out_features / 32;
  kvscope::parallel_for(0, columns, kvscope::one_share_per_thread(columns),
                        [&](int64_t begin, int64_t end) {
    kvscope::amx::configure_tiles();
    alignas(64) float sums[2 * kAmxRowBlock * 32];
    for (int64_t c = begin; c < end; ++c) {
      const kvscope::bf16* column = weight + c * 32 * in_features;
      for (int64_t first = 0; first < rows; first += 2 * kAmxRowBlock) {
        if (padded - first > kAmxRowBlock)
          amx_column<2>(x + first * in_features, in_features, column, sums);
        else
          amx_column<1>(x + first * in_features, in_features, column, sums);
        for (int64_t m = first; m < std::min(rows, first + 2 * kAmxRowBlock); ++m)
          for (int part = 0; part < 2; ++part)
            writer.write(m, c * 32 + part * 16,
                         kvscope::vec::FP32Vec16::load(sums + (m - first) * 32 + part * 16));
      }
    }
    _tile_release();
  });
}
#endif

}  // namespace

// out = x @ W.T + bias for x [rows, in] and W [out, in] stored blocked
// (`blocks` [out / T, T * in], as above), a tile column at a time; out bf16 or fp32 (the bf16
// result widened).
void linear_blocked(const at::Tensor& x, const at::Tensor& blocks,
                    const std::optional<at::Tensor>& bias, at::Tensor out) {
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = out.size(1);
  const int64_t tile = blocks.dim() == 2 && in_features > 0 ? blocks.size(1) / in_features : 0;
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16 &&
                  blocks.is_contiguous() && blocks.scalar_type() == at::kBFloat16 &&
                  (tile == 32 || tile == 64) && blocks.size(0) * tile == out_features &&
                  blocks.size(1) == tile * in_features && out.is_contiguous() &&
                  out.size(0) == rows &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat) &&
                  in_features % kTileInputs == 0 &&
                  (!bias || (bias->is_contiguous() && bias->scalar_type() == at::kBFloat16 &&
                             bias->numel() == out_features)),
              "linear_blocked: bf16 x [rows, in], blocks [out / T, T * in] (T "
              "32 or 64, in a multiple of 32), bias [out], out [rows, out] bf16 or fp32");
  if (rows == 0) return;
  const kvscope::bf16* xs = kvscope::elements<kvscope::bf16>(x);
  const kvscope::bf16* weight = kvscope::elements<kvscope::bf16>(blocks);
  const kvscope::bf16* bias_values = bias ? kvscope::elements<kvscope::bf16>(*bias) : nullptr;
  if (tile == 32) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (kvscope::amx::permitted())
      return amx_linear(xs, x.stride(0), rows, weight, bias_values, in_features, out_features, out);
#endif
    blocked_linear<32, 2>(xs, x.stride(0), rows, weight, bias_values, in_features, out_features,
                          out);
  } else if (rows <= 2)
    blocked_linear<64, 2>(xs, x.stride(0), rows, weight, bias_values, in_features, out_features,
                          out);
  else
    blocked_linear<64, 1>(xs, x.stride(0), rows, weight, bias_values, in_features, out_features,
                          out);
}

namespace {

// An op of torch's own mkldnn library, found once through the dispatcher: this extension
// links no oneDNN of its own.
template <typename Signature>
c10::TypedOperatorHandle<Signature> mkldnn_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace

bool has_blocked_linear() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

bool has_amx_linear() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return kvscope::amx::permitted();
#else
  return false;
#endif
}

at::Tensor onednn_weight_blocks(const at::Tensor& onednn) {
  static const auto data_ptr = mkldnn_op<int64_t(const at::Tensor&)>("mkldnn::data_ptr");
  static const auto nbytes = mkldnn_op<int64_t(const at::Tensor&)>("mkldnn::_nbytes");
  TORCH_CHECK(onednn.is_mkldnn() && onednn.scalar_type() == at::kBFloat16,
              "onednn_weight_blocks: a bf16 oneDNN tensor");
  const int64_t bytes = nbytes.call(onednn);
  // The view holds the oneDNN tensor, so the memory lives as long as either does.
  return at::from_blob(reinterpret_cast<void*>(data_ptr.call(onednn)), {bytes / 2},
                       [keep = onednn](void*) {}, at::TensorOptions().dtype(at::kBFloat16));
}

at::Tensor linear_onednn(const at::Tensor& x, const at::Tensor& onednn,
                         const std::optional<at::Tensor>& bias) {
  static const auto linear =
      mkldnn_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                           std::string_view, c10::List<std::optional<c10::Scalar>>,
                           std::optional<std::string_view>)>("mkldnn::_linear_pointwise");
  return linear.call(x, onednn, bias, "none", c10::List<std::optional<c10::Scalar>>(), "");
}

// out = x @ weight.T + bias for x [rows, in] with few rows (decode batches). out has x's
// dtype, or is fp32 (bf16 x: the bf16 result widened, e.g. logits for the sampler).
void linear_small_batch(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() && out.is_contiguous() &&
                  x.size(1) == weight.size(1) && out.size(0) == x.size(0) &&
                  out.size(1) == weight.size(0),
              "linear_small_batch: x [rows, in], weight [out, in], out [rows, out]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() &&
                  (out.scalar_type() == x.scalar_type() || out.scalar_type() == at::kFloat) &&
                  (!bias || (bias->is_contiguous() && bias->scalar_type() == x.scalar_type())),
              "linear_small_batch: x, weight and bias of one dtype, out of it or fp32");
  auto run = [&](auto* typed_x, auto* typed_out) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed_x)>>;
    small_batch_linear<T>(typed_x, x.stride(0), kvscope::elements<T>(weight),
                          bias ? kvscope::elements<T>(*bias) : nullptr, typed_out, out.stride(0),
                          x.size(0), x.size(1), weight.size(0));
  };
  if (x.scalar_type() == at::kFloat)
    run(kvscope::elements<float>(x), kvscope::elements<float>(out));
  else if (out.scalar_type() == at::kFloat)
    run(kvscope::elements<kvscope::bf16>(x), kvscope::elements<float>(out));
  else
    run(kvscope::elements<kvscope::bf16>(x), kvscope::elements<kvscope::bf16>(out));
}
