// The CPU ops as C++ functions, for kernels that chain them without a trip through Python
// (llama_stack_cpu.cpp). Each is also registered as torch.ops.kvscope.<name>.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

void paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     double scale, at::Tensor out);
void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
              at::Tensor value_cache, const at::Tensor& slot_mapping);
void rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps, at::Tensor out,
              std::optional<at::Tensor> residual);
void rotary_embedding(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                      int64_t heads, int64_t head_dim);
void silu_and_mul(const at::Tensor& x, at::Tensor out);
void linear_small_batch(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, at::Tensor out);
void int4_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                 const at::Tensor& offsets, int64_t group_size,
                 const std::optional<at::Tensor>& bias, at::Tensor out);
void int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                 const std::optional<at::Tensor>& bias, at::Tensor out);
void int4_dequantize(const at::Tensor& weight, const at::Tensor& scales,
                     const at::Tensor& offsets, int64_t group_size, at::Tensor out);
void int8_dequantize(const at::Tensor& weight, const at::Tensor& scales, at::Tensor out);
