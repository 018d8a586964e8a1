"""The server's chat parsing knobs (vLLM's --enable-auto-tool-choice, --tool-call-parser,
--reasoning-parser) and the parser each chat request gets from them."""

from dataclasses import dataclass

from kvscope.engine.serving.chat_output import ChatOutputParser
from kvscope.engine.serving.errors import APIError
from kvscope.engine.serving.protocol import ChatCompletionRequest
from kvscope.engine.serving.reasoning import REASONING_PARSERS
from kvscope.engine.serving.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
)


@dataclass(frozen=True)
class ChatParsing:
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        for knob, value, known in (("tool_call_parser", self.tool_call_parser, TOOL_PARSERS),
                                   ("reasoning_parser", self.reasoning_parser,
                                    REASONING_PARSERS)):
            if value is not None and value not in known:
                raise ValueError(f"{knob}={value!r}: choose one of {', '.join(sorted(known))}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice: needs tool_call_parser to read the "
                             "model's calls")

    def for_request(self, body: ChatCompletionRequest, template_has_tools: bool,
                    prompt: str = "", structured: bool = False) -> ChatOutputParser:
        """The request's parser; a 400 naming tool_choice for an auto choice this server or
        this model cannot honour (required and named calls are grammar-forced: any model).

        A `structured` output (a forced call, response_format...) keeps its reasoning
        parser only where the output starts inside the thinking (the caller then starts
        the grammar after its end marker, as vLLM does); otherwise the grammar holds from
        the first token and there is no thinking to split off.
        """
        reasoning = (REASONING_PARSERS[self.reasoning_parser](prompt)
                     if self.reasoning_parser is not None else None)
        if structured and reasoning is not None and not reasoning.thinks_without_start:
            reasoning = None
        choice = body.effective_tool_choice
        if choice == "none":
            return ChatOutputParser(reasoning)
        if choice == "auto":
            # Named after what the client sent: tools alone mean tool_choice "auto".
            field = "tools" if body.tool_choice is None else "tool_choice"
            if not self.enable_auto_tool_choice:
                raise APIError(400, f'{field}: tool_choice "auto" needs the server started '
                               "with --enable-auto-tool-choice and --tool-call-parser; "
                               'use "required" or a named function', param=field)
            if not template_has_tools:
                raise APIError(400, f'{field}: tool_choice "auto" needs a chat template that '
                               "renders tools, and this model's has none; use \"required\" "
                               "or a named function (grammar-forced)", param=field)
            return ChatOutputParser(reasoning, TOOL_PARSERS[self.tool_call_parser]())
        if choice == "required":
            return ChatOutputParser(reasoning, RequiredToolParser())
        return ChatOutputParser(reasoning, NamedToolParser(choice.function.name),
                                calls_finish=False)
