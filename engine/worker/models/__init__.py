"""Model registry: transformers architecture name -> our paged-attention implementation,
and the refusals of what none of them runs (named, with what is supported)."""

from transformers import PretrainedConfig

from kvscope.engine.worker.models.gemma import GemmaForCausalLM
from kvscope.engine.worker.models.gemma4 import Gemma4ForCausalLM
from kvscope.engine.worker.models.lfm2 import Lfm2ForCausalLM
from kvscope.engine.worker.models.llama import LlamaForCausalLM
from kvscope.engine.worker.models.moe import moe_config
from kvscope.engine.worker.models.opt import OPTForCausalLM
from kvscope.engine.worker.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,  # Llama 2/3/3.1/3.2, SmolLM2
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,  # Phi-3, Phi-3.5-mini, Phi-4-mini
    "Olmo3ForCausalLM": LlamaForCausalLM,
    "Ministral3ForCausalLM": LlamaForCausalLM,
    # its language model only (Ministral 3's published checkpoints), as Gemma 3's below
    "Mistral3ForConditionalGeneration": LlamaForCausalLM,
    # mixtures of experts (moe.py's layer as the MLP)
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "OlmoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "GptOssForCausalLM": LlamaForCausalLM,  # with attention sinks and MXFP4 experts
    "OPTForCausalLM": OPTForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    # its language model only: the vision tower's weights are skipped by name
    "Gemma3ForConditionalGeneration": GemmaForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForCausalLM,  # its language model, as Gemma 3's
    # recurrent layers beside attention: state slots (models/recurrent.py)
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,  # text only
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,  # text only, on moe.py's experts
    # Qwen3.5 as published: the language model (its vision tower is left out by name)
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForCausalLM,
}

def language_model_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config the engine serves: a supported multimodal model's text config (which carries the
    vocabulary, lengths and layers), under the checkpoint's architecture name and with its
    output projection tied as the whole model ties it."""
    text = getattr(config, "text_config", None)
    if text is None or not set(config.architectures or ()) & set(MODEL_REGISTRY):
        return config  # a text model, or a multimodal one model_class refuses by name
    text.architectures = config.architectures
    text.tie_word_embeddings = config.tie_word_embeddings
    return text


def model_class(config: PretrainedConfig) -> type:
    """The class for the config's architecture, or a ValueError naming what is not supported
    (the architecture, a part of its MoE layers, a vision tower) and listing what is."""
    supported = f"supported architectures: {sorted(MODEL_REGISTRY)}"
    moe_config(config)  # refuses a MoE layer it cannot follow, naming the field
    if getattr(config, "vision_config", None) is not None:
        raise ValueError(f"model: {config.architectures} takes vision inputs, which are not "
                         f"supported; text-only models only ({supported})")
    for architecture in config.architectures or []:
        if architecture in MODEL_REGISTRY:
            return MODEL_REGISTRY[architecture]
    raise ValueError(f"model: unsupported architecture {config.architectures}; {supported}")
