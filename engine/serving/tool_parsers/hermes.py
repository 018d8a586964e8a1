"""Hermes-style calls (Qwen2.5, Qwen3, Hermes 2/3 and most small tool models): each call
is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; text before the first call
is the content."""

import json

from kvscope.engine.serving.reasoning.base import held_back
from kvscope.engine.serving.tool_parsers.base import ExtractedToolCalls, ToolParser, as_tool_call


class HermesToolParser(ToolParser):
    start = "<tool_call>"
    end = "</tool_call>"

    def extract(self, text: str, final: bool) -> ExtractedToolCalls:
        first = text.find(self.start)
        if first < 0:
            keep = len(text) if final else len(text) - held_back(text, self.start)
            return ExtractedToolCalls(text[:keep])
        content, calls = [text[:first]], []
        position = first
        while position >= 0:
            body_start = position + len(self.start)
            close = text.find(self.end, body_start)
            if close < 0 and not final:
                break  # this call is still being written
            body = text[body_start:] if close < 0 else text[body_start:close]
            call = _decoded_call(body)
            if call is None:  # not a call after all: its text is content
                content.append(text[position:] if close < 0 else
                               text[position:close + len(self.end)])
            else:
                calls.append(call)
            if close < 0:
                break
            position = text.find(self.start, close + len(self.end))
        return ExtractedToolCalls("".join(content), calls)


def _decoded_call(body: str):
    try:
        return as_tool_call(json.loads(body), ("arguments",))
    except json.JSONDecodeError:
        return None
