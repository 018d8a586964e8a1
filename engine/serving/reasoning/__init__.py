"""Reasoning parsers (`--reasoning-parser`): split a reasoning model's output into its
thinking (`reasoning_content`) and its answer (`content`), as vLLM's of the same names."""

from kvscope.engine.serving.reasoning.base import ReasoningParser, held_back
from kvscope.engine.serving.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from kvscope.engine.serving.reasoning.openai_gptoss import GptOssReasoningParser
from kvscope.engine.serving.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "openai_gptoss": GptOssReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}

__all__ = ["REASONING_PARSERS", "ReasoningParser", "held_back"]
