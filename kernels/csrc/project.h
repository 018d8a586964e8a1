// A linear layer's weights in every form the CPU kernels take (dense, prepacked tiles, packed
// int4 / int8, GGUF blocks) and `project`, which runs one the way the Python modules do: the
// decoder stack (llama_stack.cpp) and the experts of a mixture-of-experts layer (moe.cpp)
// call it, so every C++ caller picks the same kernel for the same rows.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace kvscope {

// A linear layer's tensors: a dense weight, or a packed int4 (uint8) / int8 one with its
// scales (and int4 offsets) as engine/worker/models/quantized.py packs them. A dense bf16
// weight prepacked (kernels/cpu_kernels.py's prepack_weight) has a `tile` width T: `weight`
// holds its tiles [out / T, T * in], oneDNN's AMX tiles (T = 32; `onednn` is its opaque tensor
// over the same memory where the GEMM takes it) or kvscope's own (T = 64). A GGUF
// layer (quantized.py's GgufLinear) comes as runs of rows, each a tensor of one GGUF type's
// blocks (or dense, type -1): `gguf_parts` [runs, 3] holds each run's (type, first row, end
// row).
struct LinearWeights {
  // kernels/cpu_kernels.py's AMX_TILE_OUTPUTS and WIDE_TILE_OUTPUTS.
  static constexpr int64_t kAmxTileOutputs = 32, kOwnTileOutputs = 64;

  at::Tensor weight;
  std::optional<at::Tensor> bias, scales, offsets, onednn, gguf_parts;
  std::vector<at::Tensor> gguf_weights;
  int64_t tile = 0;  // outputs per tile of a prepacked weight; 0: plain

  int64_t out_features() const {
    if (gguf_parts) return gguf_parts->data_ptr<int64_t>()[gguf_parts->numel() - 1];
    return tile ? weight.size(0) * tile : weight.size(0);
  }
};

// Where packed weights stop streaming: int4 weights' inputs per scale (0 without them), and
// the most rows of activations that stream through the packed kernels (more de-quantize the
// weight for a GEMM; engine/worker/models/quantized.py's kernel_max_rows).
struct ProjectLimits {
  int64_t group_size = 0;
  int64_t kernel_max_rows = 0;
};

// out = x @ weight.T (+ bias), in x's dtype or (the logits) fp32, as kernels/cpu_kernels.py's
// linear and the packed modules compute it. oneDNN's GEMM over AMX tiles may hand back a
// tensor of its own: it then becomes `out`.
void project(const at::Tensor& x, const LinearWeights& linear, const ProjectLimits& limits,
             at::Tensor& out);

// Calls `op` inside a profiler range named like the op's own registration, so a profile of
// the C++ callers reads as a profile of the ops (torch.profiler sees no dispatcher calls here).
template <typename Op>
auto traced(const char* name, Op&& op) {
  RECORD_FUNCTION(name, std::vector<c10::IValue>());
  return op();
}

}  // namespace kvscope
