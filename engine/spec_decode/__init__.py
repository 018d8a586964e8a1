"""Speculative decoding: cheap proposals verified exactly by the target model (vLLM v1's
vllm/v1/spec_decode)."""
