"""kvscope's engine: paged KV cache, continuous batching and the offline LLM API."""

from engine.beam_search import BeamSearchParams
from engine.config import EngineConfig
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "BeamSearchParams", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]
