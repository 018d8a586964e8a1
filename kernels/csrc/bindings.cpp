// Every op and class of the kvscope library, registered with torch: the ops as
// torch.ops.kvscope.<name>, the decoder stack as torch.classes.kvscope.LlamaDecoderStack.
// kernels/cpu_kernels.py is the one Python module that reaches them. The kernels themselves
// are plain C++ functions (cpu_ops.h) in their own files.
#include <torch/custom_class.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "llama_stack.h"

TORCH_LIBRARY(kvscope, m) {
  // attention/paged_attention.cpp
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, float scale, Tensor(a!) out, int window=0, "
        "float soft_cap=0., Tensor? sinks=None) -> ()");
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
  // fused_ops.cpp
  m.def("rms_norm(Tensor hidden, Tensor weight, float eps, Tensor(a!) out, "
        "Tensor(b!)? residual, bool unit_offset=False) -> ()");
  m.def("rotary_embedding(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads, "
        "int head_dim) -> ()");
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
  m.def("gelu_tanh_and_mul(Tensor x, Tensor(a!) out) -> ()");
  // dense_linear.cpp
  m.def("linear_small_batch(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("linear_blocked(Tensor x, Tensor blocks, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("has_blocked_linear() -> bool", &has_blocked_linear);
  m.def("has_amx_linear() -> bool", &has_amx_linear);
  m.def("onednn_weight_blocks(Tensor onednn) -> Tensor", &onednn_weight_blocks);
  // widened_gemm.cpp
  m.def("linear_widened(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("widens_bf16_gemms() -> bool", &widens_bf16_gemms);
  // quantized/int4.cpp, quantized/int8.cpp
  m.def("int4_linear(Tensor x, Tensor weight, Tensor scales, Tensor offsets, int group_size, "
        "Tensor? bias, Tensor(a!) out) -> ()");
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales, Tensor? bias, "
        "Tensor(a!) out) -> ()");
  m.def("int4_dequantize(Tensor weight, Tensor scales, Tensor offsets, int group_size, "
        "Tensor(a!) out) -> ()");
  m.def("int8_dequantize(Tensor weight, Tensor scales, Tensor(a!) out) -> ()");
  m.def("rounds_activations_to_int8() -> bool", &rounds_activations_to_int8);
  // quantized/kquants.cpp
  m.def("gguf_linear(Tensor x, Tensor weight, int type, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("gguf_dequantize(Tensor weight, int type, Tensor(a!) out) -> ()");
  m.def("gguf_rounds_activations_to_int8() -> bool", &gguf_rounds_activations_to_int8);
  m.def("gguf_repacked_type(int type) -> int", &gguf_repacked_type);
  // quantized/mxfp4.cpp
  m.def("mxfp4_linear(Tensor x, Tensor blocks, Tensor scales, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("mxfp4_dequantize(Tensor blocks, Tensor scales, Tensor(a!) out) -> ()");
  // moe.cpp
  m.def("moe_experts(Tensor hidden, Tensor expert_ids, Tensor expert_weights, Tensor gate_up, "
        "Tensor? gate_up_bias, Tensor? gate_up_scales, Tensor? gate_up_offsets, Tensor down, "
        "Tensor? down_bias, Tensor? down_scales, Tensor? down_offsets, int group_size, "
        "int kernel_max_rows, str activation, Tensor(a!) out, Tensor(b!)? expert_counts, "
        "int num_experts, Tensor[] gate_up_gguf, Tensor[] down_gguf) -> ()");
  // recurrent/causal_conv.cpp, recurrent/delta_rule.cpp
  m.def("causal_conv1d_prefill(Tensor x, Tensor(a!) conv_state, int slot, Tensor weight, "
        "Tensor? bias, str activation, Tensor(b!) out) -> ()");
  m.def("causal_conv1d_decode(Tensor x, Tensor(a!) conv_state, Tensor slots, Tensor weight, "
        "Tensor? bias, str activation, Tensor(b!) out) -> ()");
  m.def("gated_delta_rule_prefill(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
        "Tensor(a!) state, int slot, bool use_qk_l2norm, Tensor(b!) out) -> ()");
  m.def("gated_delta_rule_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
        "Tensor(a!) state, Tensor slots, bool use_qk_l2norm, Tensor(b!) out) -> ()");
  // memory_probe.cpp
  m.def("read_words(Tensor words) -> int", &read_words);
  // sampling.cpp
  m.def("greedy_tokens(Tensor logits) -> (int[], float[])");

  // llama_stack.cpp; every argument by name from Python.
  m.class_<LlamaDecoderStack>("LlamaDecoderStack")
      .def(torch::init<at::Tensor, std::optional<at::Tensor>, at::Tensor, std::optional<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::optional<at::Tensor>, at::Tensor,
                       const c10::List<kvscope::NamedTensors>&,
                       const c10::List<c10::Dict<std::string, int64_t>>&,
                       const c10::Dict<std::string, double>&, int64_t, int64_t, int64_t, int64_t,
                       int64_t, double, double>(),
           "",
           {torch::arg("embedding"), torch::arg("embedding_scales"), torch::arg("head"),
            torch::arg("head_scales"), torch::arg("cos"), torch::arg("sin"),
            torch::arg("query_scale"), torch::arg("final_norm"), torch::arg("layers"), torch::arg("layer_options"),
            torch::arg("model_options"), torch::arg("num_heads"), torch::arg("num_kv_heads"),
            torch::arg("head_dim"), torch::arg("group_size"), torch::arg("kernel_max_rows"),
            torch::arg("eps"), torch::arg("attention_scale")})
      .def("forward", &LlamaDecoderStack::forward)
      .def("logits", &LlamaDecoderStack::logits);
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("store_kv", &store_kv);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("linear_small_batch", &linear_small_batch);
  m.impl("linear_blocked", &linear_blocked);
  m.impl("linear_widened", &linear_widened);
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("int8_dequantize", &int8_dequantize);
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("mxfp4_linear", &mxfp4_linear);
  m.impl("mxfp4_dequantize", &mxfp4_dequantize);
  m.impl("moe_experts", &moe_experts);
  m.impl("causal_conv1d_prefill", &causal_conv1d_prefill);
  m.impl("causal_conv1d_decode", &causal_conv1d_decode);
  m.impl("gated_delta_rule_prefill", &gated_delta_rule_prefill);
  m.impl("gated_delta_rule_decode", &gated_delta_rule_decode);
  m.impl("greedy_tokens", &greedy_tokens);
}
