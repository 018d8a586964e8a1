"""Qwen3: `<think>...</think>` then the answer. Its template opens no thinking block when
`enable_thinking` is on (the model writes `<think>`), and writes an empty one when it is
off, so output without `<think>` is all answer."""

from kvscope.engine.serving.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    thinks_without_start = False
