"""DeepSeek-R1 and its distills: the template opens `<think>` in the prompt, so the output
is thinking until `</think>` (a leading `<think>` the model repeats is dropped)."""

from kvscope.engine.serving.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    thinks_without_start = True
