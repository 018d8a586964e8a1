"""Grammar-forced tool calls (vLLM's way): for `tool_choice="required"` the model writes a
JSON array of {"name", "parameters"} objects, for a named function the function's
arguments object; the structured-output engine holds it to the schema, so the text always
parses, unless max_tokens cut it (then it is returned as content)."""

import json
from typing import Any

from kvscope.engine.serving.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    as_tool_call,
)

ANY_OBJECT = {"type": "object"}


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of one or more calls (one if not `parallel`) of the given functions
    ({"name", "parameters"} each)."""
    call = {"anyOf": [{"type": "object",
                       "properties": {"name": {"enum": [function["name"]]},
                                      "parameters": function.get("parameters") or ANY_OBJECT},
                       "required": ["name", "parameters"], "additionalProperties": False}
                      for function in functions]}
    schema = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class RequiredToolParser(ToolParser):
    def extract(self, text: str, final: bool) -> ExtractedToolCalls:
        if not final:
            return ExtractedToolCalls("")  # the array is complete only at the end
        try:
            values = json.loads(text)
        except json.JSONDecodeError:
            return ExtractedToolCalls(text)
        calls = [as_tool_call(value, ("parameters",)) for value in values]
        if not calls or None in calls:
            return ExtractedToolCalls(text)
        return ExtractedToolCalls("", calls)


class NamedToolParser(ToolParser):
    def __init__(self, name: str) -> None:
        self.name = name

    def extract(self, text: str, final: bool) -> ExtractedToolCalls:
        if not final:
            return ExtractedToolCalls("")
        try:
            arguments = json.loads(text)
        except json.JSONDecodeError:
            return ExtractedToolCalls(text)
        return ExtractedToolCalls("", [ToolCall(self.name, json.dumps(arguments,
                                                                      ensure_ascii=False))])
