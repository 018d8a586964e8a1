"""What every tool-call parser returns, and the JSON helpers they share."""

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass(frozen=True, slots=True)
class ExtractedToolCalls:
    content: str
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser(ABC):
    """Turns the model's answer text into content and tool calls.

    `extract(text, final)` answers for the output so far. While it still grows
    (`final=False`) both parts only ever grow (content text is kept back while it may be
    the start of a call; a call appears once it is complete), so a stream sends the
    difference between two answers.
    """

    # Whether it reads the whole output rather than what follows the reasoning (harmony's
    # calls sit among the reasoning's messages), and then returns the answer's content.
    reads_whole_output = False
    # Whether its markers are special tokens, which the output's text must then keep.
    reads_special_tokens = False

    @abstractmethod
    def extract(self, text: str, final: bool) -> ExtractedToolCalls: ...


def as_tool_call(value: Any, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """A decoded {"name": ..., <arguments key>: {...}} object as a ToolCall, else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[key] for key in arguments_keys if key in value), {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
