// mxfp4_linear and mxfp4_dequantize: weights in MXFP4 as gpt-oss ships its experts, kept packed
// (kernels/mxfp4.py describes the format: per 32 inputs, 16 bytes of e2m1 codes, input 2j in
// byte j's low nibble and 2j + 1 in its high one, and one e8m0 scale byte).
//
// The linear streams the packed bytes once for up to kMaxRows rows of x, exactly: a group's
// 32 codes widen to fp32 through a 16-value table (vec::lookup16), its low nibbles dot with
// the group's even inputs and its high ones with the odd ones (x is split so once per call),
// and the group's sum takes its power-of-two scale. Many rows de-quantize the weight for a
// GEMM instead (engine/worker/models/quantized.py's kernel_max_rows).
#include <ATen/core/Tensor.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "cpu_ops.h"
#include "quantized/common.h"
#include "work_pool.h"

namespace kvscope::quantized {
namespace {

constexpr int64_t kGroup = 32, kGroupBytes = 16;

// e2m1's 16 codes: sign bit 3, then 2 exponent bits and 1 mantissa bit.
alignas(64) constexpr float kFp4Values[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                                              -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// 2^(s - 127) for every e8m0 byte s (255, e8m0's NaN, reads as 2^128 = inf, as
// transformers' ldexp de-quantization gives it).
const std::array<float, 256>& scale_values() {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> table{};
    for (int s = 0; s < 256; ++s) table[s] = std::ldexp(1.f, s - 127);
    return table;
  }();
  return values;
}

// A group's codes widened to fp32: its even inputs' values (low nibbles) and odd ones' (high).
struct Fp4Group {
  FP32Vec16 even, odd;

  static Fp4Group load(const uint8_t* bytes, FP32Vec16 table) {
    const vec::u32x16 codes = FP32Vec16::widen_u8(vec::load_unaligned<vec::u8x16>(bytes));
    return {vec::lookup16(table, codes), vec::lookup16(table, codes >> 4)};
  }
};

// Rows of x widened to fp32, each group's 32 inputs split into its 16 even and 16 odd ones.
template <typename T>
std::vector<float> split_rows(const T* x, int64_t x_stride, int64_t rows, int64_t in) {
  std::vector<float> split(rows * in);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t k = 0; k < in; ++k) {
      const int64_t group = k / kGroup, lane = k % kGroup;
      split[m * in + group * kGroup + (lane % 2) * 16 + lane / 2] = load(x[m * x_stride + k]);
    }
  return split;
}

// out[m, n] for M rows of (split) x and output rows [begin, end). Even and odd groups add into
// separate accumulators: two dependent chains, not one. A row's sum takes the same steps
// whatever M is, so each row of a short chunk gets bit for bit what it gets alone.
template <int M, typename T, typename Out>
void mxfp4_rows(const float* xs, int64_t in, const uint8_t* blocks, const uint8_t* scales,
                const T* bias, Out* out, int64_t out_stride, int64_t begin, int64_t end) {
  const FP32Vec16 table = FP32Vec16::load(kFp4Values);
  const std::array<float, 256>& scale_of = scale_values();
  const int64_t groups = in / kGroup;
  for (int64_t first = begin; first < end; first += kRowBlock) {
    const int64_t count = std::min(kRowBlock, end - first);
    float y[M][kRowBlock];
    for (int64_t i = 0; i < count; ++i) {
      const uint8_t* row = blocks + (first + i) * groups * kGroupBytes;
      const uint8_t* row_scales = scales + (first + i) * groups;
      FP32Vec16 even_groups[M], odd_groups[M];
      auto add_group = [&](int64_t g, FP32Vec16* acc) {
        const Fp4Group w = Fp4Group::load(row + g * kGroupBytes, table);
        const FP32Vec16 scale(scale_of[row_scales[g]]);
        for (int m = 0; m < M; ++m) {
          const float* xm = xs + m * in + g * kGroup;
          const FP32Vec16 dot =
              vec::fma(w.even, FP32Vec16::load(xm), w.odd * FP32Vec16::load(xm + 16));
          acc[m] = vec::fma(dot, scale, acc[m]);
        }
      };
      int64_t g = 0;
      for (; g + 2 <= groups; g += 2) {
        add_group(g, even_groups);
        add_group(g + 1, odd_groups);
      }
      if (g < groups) add_group(g, even_groups);
      for (int m = 0; m < M; ++m)
        y[m][i] = (even_groups[m] + odd_groups[m]).add_halves().reduce_sum();
    }
    store_block<M>(out, out_stride, first, count, y, bias);
  }
}

template <typename T, typename Out>
void mxfp4_linear_impl(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& scales,
                       const T* bias, at::Tensor& out) {
  const int64_t in = x.size(1), out_features = blocks.size(0);
  const int64_t row_bytes = in / 2 + in / kGroup;
  for (int64_t first = 0; first < x.size(0); first += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, x.size(0) - first));
    const std::vector<float> xs =
        split_rows(elements<T>(x) + first * x.stride(0), x.stride(0), rows, in);
    Out* y = elements<Out>(out) + first * out.stride(0);
    with_rows<kMaxRows>(rows, [&](auto rows_constant) {
      constexpr int M = decltype(rows_constant)::value;
      kvscope::parallel_for(0, out_features, grain(row_bytes), [&](int64_t begin, int64_t end) {
        mxfp4_rows<M, T>(xs.data(), in, blocks.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(),
                         bias, y, out.stride(0), begin, end);
      });
    });
  }
}

// The weight is [out, in / 32, 16] blocks and [out, in / 32] scales; returns in.
int64_t check_mxfp4_weight(const at::Tensor& blocks, const at::Tensor& scales, const char* op) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 &&
                  blocks.size(2) == kGroupBytes && blocks.is_contiguous(),
              op, ": blocks contiguous uint8 [out_features, in / 32, 16]");
  TORCH_CHECK(scales.scalar_type() == at::kByte && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == blocks.size(0) && scales.size(1) == blocks.size(1),
              op, ": scales contiguous uint8 [out_features, in / 32]");
  return blocks.size(1) * kGroup;
}

}  // namespace
}  // namespace kvscope::quantized

using namespace kvscope::quantized;

// out = x @ W.T + bias with W in MXFP4 (blocks, scales). out has x's dtype, or is fp32 for
// bf16 x (logits): the bf16 result widened, written directly.
void mxfp4_linear(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& scales,
                  const std::optional<at::Tensor>& bias, at::Tensor out) {
  using kvscope::bf16;
  const int64_t in = check_mxfp4_weight(blocks, scales, "mxfp4_linear");
  check_rows(x, blocks, in, bias, out, "mxfp4_linear", /*widened_out=*/true);
  if (x.scalar_type() == at::kFloat)
    mxfp4_linear_impl<float, float>(x, blocks, scales, bias_data<float>(bias), out);
  else if (out.scalar_type() == at::kFloat)
    mxfp4_linear_impl<bf16, float>(x, blocks, scales, bias_data<bf16>(bias), out);
  else
    mxfp4_linear_impl<bf16, bf16>(x, blocks, scales, bias_data<bf16>(bias), out);
}

// out [out_features, in] = the de-quantized weight (exact in fp32 and bf16), for the GEMM of
// many rows.
void mxfp4_dequantize(const at::Tensor& blocks, const at::Tensor& scales, at::Tensor out) {
  const int64_t in = check_mxfp4_weight(blocks, scales, "mxfp4_dequantize");
  check_dense_out(blocks, in, out, "mxfp4_dequantize");
  const FP32Vec16 table = FP32Vec16::load(kFp4Values);
  const std::array<float, 256>& scale_of = scale_values();
  const uint8_t* packed = blocks.data_ptr<uint8_t>();
  const uint8_t* row_scales = scales.data_ptr<uint8_t>();
  with_out_dtype(out, "mxfp4_dequantize", [&](auto* y) {
    kvscope::parallel_for(0, blocks.size(0), grain(in / 2), [&](int64_t begin, int64_t end) {
      for (int64_t group = begin * (in / kGroup); group < end * (in / kGroup); ++group) {
        const Fp4Group w = Fp4Group::load(packed + group * kGroupBytes, table);
        const float scale = scale_of[row_scales[group]];
        for (int j = 0; j < 16; ++j) {
          kvscope::store(y[group * kGroup + 2 * j], w.even.reg[j] * scale);
          kvscope::store(y[group * kGroup + 2 * j + 1], w.odd.reg[j] * scale);
        }
      }
    });
  });
}
