// The CPU ops as C++ functions: each kernel file defines some of them, bindings.cpp registers
// every one as torch.ops.kvscope.<name>, and llama_stack.cpp chains them without a trip
// through Python.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

// attention/paged_attention.cpp
void paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                     at::Tensor out, int64_t window, double soft_cap,
                     const std::optional<at::Tensor>& sinks);
void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
              at::Tensor value_cache, const at::Tensor& slot_mapping);

// fused_ops.cpp
void rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps, at::Tensor out,
              std::optional<at::Tensor> residual, bool unit_offset);
void rotary_embedding(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                      int64_t head_dim);
void silu_and_mul(const at::Tensor& x, at::Tensor out);
void gelu_tanh_and_mul(const at::Tensor& x, at::Tensor out);

// dense_linear.cpp
void linear_small_batch(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, at::Tensor out);
void linear_blocked(const at::Tensor& x, const at::Tensor& blocks,
                    const std::optional<at::Tensor>& bias, at::Tensor out);
bool has_blocked_linear();  // whether linear_blocked was built (AVX512-BF16)
bool has_amx_linear();      // whether it streams oneDNN's AMX tiles on AMX (built, permitted)
// A prepacked oneDNN weight (torch.ops.mkldnn._reorder_linear_weight) as a bf16 tensor over
// the same memory, and oneDNN's GEMM over it.
at::Tensor onednn_weight_blocks(const at::Tensor& onednn);
at::Tensor linear_onednn(const at::Tensor& x, const at::Tensor& onednn,
                         const std::optional<at::Tensor>& bias);

// widened_gemm.cpp: bf16 GEMMs as fp32 GEMMs over weight tiles widened per call, for CPUs
// without bf16 dot products (widens_bf16_gemms: this build's CPU is one)
bool widens_bf16_gemms();
void linear_widened(const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, at::Tensor out);

// quantized/int4.cpp, quantized/int8.cpp
void int4_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                 const at::Tensor& offsets, int64_t group_size,
                 const std::optional<at::Tensor>& bias, at::Tensor out);
void int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                 const std::optional<at::Tensor>& bias, at::Tensor out);
void int4_dequantize(const at::Tensor& weight, const at::Tensor& scales, const at::Tensor& offsets,
                     int64_t group_size, at::Tensor out);
void int8_dequantize(const at::Tensor& weight, const at::Tensor& scales, at::Tensor out);
bool rounds_activations_to_int8();

// quantized/kquants.cpp
void gguf_linear(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                 const std::optional<at::Tensor>& bias, at::Tensor out);
void gguf_dequantize(const at::Tensor& weight, int64_t type, at::Tensor out);
bool gguf_rounds_activations_to_int8();
int64_t gguf_repacked_type(int64_t type);

// quantized/mxfp4.cpp
void mxfp4_linear(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& scales,
                  const std::optional<at::Tensor>& bias, at::Tensor out);
void mxfp4_dequantize(const at::Tensor& blocks, const at::Tensor& scales, at::Tensor out);

// moe.cpp: a mixture-of-experts layer's experts over a step's tokens (moe.h)
void moe_experts(const at::Tensor& hidden, const at::Tensor& expert_ids,
                 const at::Tensor& expert_weights, const at::Tensor& gate_up,
                 const std::optional<at::Tensor>& gate_up_bias,
                 const std::optional<at::Tensor>& gate_up_scales,
                 const std::optional<at::Tensor>& gate_up_offsets, const at::Tensor& down,
                 const std::optional<at::Tensor>& down_bias,
                 const std::optional<at::Tensor>& down_scales,
                 const std::optional<at::Tensor>& down_offsets, int64_t group_size,
                 int64_t kernel_max_rows, const std::string& activation, at::Tensor out,
                 const std::optional<at::Tensor>& expert_counts, int64_t num_experts,
                 const std::vector<at::Tensor>& gate_up_gguf,
                 const std::vector<at::Tensor>& down_gguf);

// recurrent/causal_conv.cpp, recurrent/delta_rule.cpp: the recurrent layers' ops over a pool
// of per-sequence states, updated in place (contracts: kernels/reference.py); activation
// "" (none) or "silu"; g and beta fp32 [rows, value_heads]
void causal_conv1d_prefill(const at::Tensor& x, at::Tensor conv_state, int64_t slot,
                           const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           const std::string& activation, at::Tensor out);
void causal_conv1d_decode(const at::Tensor& x, at::Tensor conv_state, const at::Tensor& slots,
                          const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const std::string& activation, at::Tensor out);
void gated_delta_rule_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& g, const at::Tensor& beta, at::Tensor state,
                              int64_t slot, bool use_qk_l2norm, at::Tensor out);
void gated_delta_rule_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& g, const at::Tensor& beta, at::Tensor state,
                             const at::Tensor& slots, bool use_qk_l2norm, at::Tensor out);

// memory_probe.cpp: the wrapping sum of a contiguous int64 tensor's words, read over the
// kernels' threads (the read-bandwidth probe)
int64_t read_words(const at::Tensor& words);

// sampling.cpp
std::tuple<std::vector<int64_t>, std::vector<double>> greedy_tokens(const at::Tensor& logits);
