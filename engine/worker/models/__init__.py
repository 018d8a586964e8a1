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
    # its language model only: the vision tower's weights are skipped by name
    "Gemma3ForConditionalGeneration": GemmaForCausalLM,
}


def language_model_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config the engine serves: a multimodal model's text config (which carries the
    vocabulary, lengths and layers), under the checkpoint's architecture name and with its
    output projection tied as the whole model ties it."""
    text = getattr(config, "text_config", None)
    if text is None:
        return config
    text.architectures = config.architectures
    text.tie_word_embeddings = config.tie_word_embeddings
    return text


def model_class(config: PretrainedConfig) -> type:
    """The class for the config's architecture, or a ValueError listing what is supported."""
    for architecture in config.architectures or []:
        if architecture in MODEL_REGISTRY:
            return MODEL_REGISTRY[architecture]
    raise ValueError(
        f"model: unsupported architecture {config.architectures}; "
        f"supported: {sorted(MODEL_REGISTRY)}")
