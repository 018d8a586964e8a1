"""A chat answer's text -> OpenAI's message fields: `reasoning_content` (a reasoning
parser's), `content`, and `tool_calls` (a tool parser's), whole or as stream deltas."""

import uuid
from dataclasses import dataclass, field

from kvscope.engine.serving.reasoning import ReasoningParser
from kvscope.engine.serving.tool_parsers import ToolCall, ToolParser


@dataclass(frozen=True, slots=True)
class ParsedAnswer:
    reasoning: str
    content: str
    calls: list[ToolCall]


@dataclass(frozen=True)
class ChatOutputParser:
    """The reasoning parser reads the whole text, the tool parser what follows the
    reasoning. `calls_finish`: a parsed call ends the choice with finish_reason
    "tool_calls" (OpenAI's for auto and required; a named function's ends with "stop")."""

    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None
    calls_finish: bool = True

    @property
    def reads_special_tokens(self) -> bool:
        """Whether the answer must be detokenized with its special tokens (harmony's
        markers are)."""
        return any(parser is not None and parser.reads_special_tokens
                   for parser in (self.reasoning, self.tools))

    def parse(self, text: str, final: bool) -> ParsedAnswer:
        reasoning, answer = "", text
        if self.reasoning is not None:
            split = self.reasoning.extract(text, final)
            reasoning, answer = split.reasoning, split.content
        if self.tools is None:
            return ParsedAnswer(reasoning, answer, [])
        extracted = self.tools.extract(text if self.tools.reads_whole_output else answer, final)
        return ParsedAnswer(reasoning, extracted.content, extracted.calls)

    def message(self, text: str) -> dict:
        """The non-streamed choice's message."""
        parsed = self.parse(text, final=True)
        message = {"role": "assistant", "content": parsed.content}
        if self.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning or None
        if parsed.calls:  # OpenAI's content is null beside calls, unless the model wrote some
            message["content"] = parsed.content or None
            message["tool_calls"] = [_call_json(call, new_call_id()) for call in parsed.calls]
        return message

    def finish_reason(self, text: str, engine_reason: str | None) -> str | None:
        if engine_reason == "stop" and self.calls_finish and self.parse(text, True).calls:
            return "tool_calls"
        return engine_reason


@dataclass
class ChatDeltaStream:
    """One streamed choice: each call returns what is new since the last as delta fields."""

    parser: ChatOutputParser
    reasoning_sent: int = 0
    content_sent: int = 0
    call_ids: list[str] = field(default_factory=list)

    def delta(self, text: str, final: bool) -> dict:
        parsed = self.parser.parse(text, final)
        delta: dict = {}
        if len(parsed.reasoning) > self.reasoning_sent:
            delta["reasoning_content"] = parsed.reasoning[self.reasoning_sent:]
            self.reasoning_sent = len(parsed.reasoning)
        new_calls = parsed.calls[len(self.call_ids):]
        if new_calls:
            first = len(self.call_ids)
            self.call_ids.extend(new_call_id() for _ in new_calls)
            delta["tool_calls"] = [{"index": index, **_call_json(call, self.call_ids[index])}
                                   for index, call in enumerate(new_calls, start=first)]
        if len(parsed.content) > self.content_sent or not delta:
            delta["content"] = parsed.content[self.content_sent:]
            self.content_sent = len(parsed.content)
        return delta


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call_json(call: ToolCall, call_id: str) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
