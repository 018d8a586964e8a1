"""gpt-oss's calls (vLLM's `openai` parser): harmony messages to `functions.NAME`, each
body the call's JSON arguments (reasoning/harmony.py reads the messages). The calls may
follow reasoning and preambles, so this parser reads the whole output, and its content is
the answer's visible text: the final channel and the preambles."""

import json

from kvscope.engine.serving.reasoning import harmony
from kvscope.engine.serving.tool_parsers.base import ExtractedToolCalls, ToolCall, ToolParser


class OpenAIToolParser(ToolParser):
    reads_whole_output = True
    reads_special_tokens = True

    def extract(self, text: str, final: bool) -> ExtractedToolCalls:
        messages = harmony.parse_messages(text, final)
        calls = [ToolCall(m.recipient.removeprefix("functions."), _arguments(m))
                 for m in messages if harmony.is_tool_call(m) and m.complete]
        return ExtractedToolCalls(harmony.visible_text(messages), calls)


def _arguments(message: harmony.HarmonyMessage) -> str:
    """A JSON body (harmony's default type) re-encoded compactly; a body of another type, or
    JSON that does not parse, as the model wrote it."""
    if message.content_type is not None and "json" not in message.content_type:
        return message.body
    try:
        return json.dumps(json.loads(message.body), ensure_ascii=False)
    except json.JSONDecodeError:
        return message.body
