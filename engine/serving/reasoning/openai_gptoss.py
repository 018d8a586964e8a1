"""gpt-oss (vLLM's `openai_gptoss`): its harmony output's `analysis` channel is the
reasoning, its `final` channel and its preambles (commentary to nobody) the answer; tool
calls (commentary to `functions.NAME`) are left to the `openai` tool parser
(harmony.py reads the messages)."""

from kvscope.engine.serving.reasoning import harmony
from kvscope.engine.serving.reasoning.base import Reasoning, ReasoningParser


class GptOssReasoningParser(ReasoningParser):
    start = harmony.CHANNEL + "analysis" + harmony.MESSAGE
    # Structured outputs start after it (the answer's header, wherever the model opens one).
    end = harmony.CHANNEL + "final" + harmony.MESSAGE
    thinks_without_start = True  # harmony's answers open with the analysis channel
    reads_special_tokens = True

    def extract(self, text: str, final: bool) -> Reasoning:
        messages = harmony.parse_messages(text, final)
        reasoning = "\n".join(m.body for m in messages if m.channel == "analysis")
        ended = any(m.channel != "analysis" for m in messages)
        return Reasoning(reasoning, harmony.visible_text(messages), ended)
