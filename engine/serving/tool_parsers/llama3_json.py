"""Llama 3.x JSON calls: the answer is one or more `{"name": ..., "parameters": {...}}`
objects separated by `;`, optionally after `<|python_tag|>`; any other answer is content."""

import json

from kvscope.engine.serving.reasoning.base import held_back
from kvscope.engine.serving.tool_parsers.base import ExtractedToolCalls, ToolParser, as_tool_call

PYTHON_TAG = "<|python_tag|>"
DECODER = json.JSONDecoder()


class Llama3JsonToolParser(ToolParser):
    def extract(self, text: str, final: bool) -> ExtractedToolCalls:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        if not final and (not body or held_back(body, PYTHON_TAG) == len(body)):
            return ExtractedToolCalls("")  # the tag or a call may yet come
        if not body.startswith("{"):
            return ExtractedToolCalls(text)
        calls, position = [], 0
        while position < len(body):
            try:
                value, position = DECODER.raw_decode(body, position)
            except json.JSONDecodeError:
                break  # an unfinished object (or not JSON: content, once final)
            call = as_tool_call(value, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
            position = _after_separator(body, position)
        if not final:  # what follows the complete calls may yet be another call
            return ExtractedToolCalls("", calls)
        # Text after the calls that is not a call is content (all of it, with no call).
        return ExtractedToolCalls(body[position:] if calls else text, calls)


def _after_separator(body: str, position: int) -> int:
    rest = body[position:].lstrip()
    if rest.startswith(";"):
        rest = rest[1:].lstrip()
    return len(body) - len(rest)
