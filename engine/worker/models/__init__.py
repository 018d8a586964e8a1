"""Model registry: transformers architecture name -> our paged-attention implementation."""

from transformers import PretrainedConfig

from kvscope.engine.worker.models.gemma import GemmaForCausalLM
from kvscope.engine.worker.models.llama import LlamaForCausalLM
from kvscope.engine.worker.models.opt import OPTForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}


def model_class(config: PretrainedConfig) -> type:
    """The class for the config's architecture, or a ValueError listing what is supported."""
    for architecture in config.architectures or []:
        if architecture in MODEL_REGISTRY:
            return MODEL_REGISTRY[architecture]
    raise ValueError(
        f"model: unsupported architecture {config.architectures}; "
        f"supported: {sorted(MODEL_REGISTRY)}")
