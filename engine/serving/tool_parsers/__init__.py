"""Tool-call parsers (`--tool-call-parser`): a model's answer text -> content and OpenAI
tool calls, as vLLM's parsers of the same names; and the parsers of grammar-forced calls
(`tool_choice` "required" or a named function), whose text is JSON by construction."""

from kvscope.engine.serving.tool_parsers.base import ExtractedToolCalls, ToolCall, ToolParser
from kvscope.engine.serving.tool_parsers.forced import NamedToolParser, RequiredToolParser
from kvscope.engine.serving.tool_parsers.hermes import HermesToolParser
from kvscope.engine.serving.tool_parsers.llama3_json import Llama3JsonToolParser
from kvscope.engine.serving.tool_parsers.openai import OpenAIToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "openai": OpenAIToolParser,
}

__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "NamedToolParser", "RequiredToolParser",
           "ToolCall", "ToolParser"]
