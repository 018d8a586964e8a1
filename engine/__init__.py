"""kvscope's engine: paged KV cache, continuous batching and the offline LLM API."""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
