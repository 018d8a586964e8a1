"""Request bodies of the OpenAI-compatible API (OpenAI's fields and vLLM's extensions, given
top-level or through the openai client's `extra_body`), and their translation to
SamplingParams.

No field is silently ignored: a field is implemented, or a documented no-op (the README
lists them), or refused with a 400 that names it.
"""

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvscope.engine.orchestrator.beam_search import BeamSearchParams
from kvscope.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvscope.engine.serving.errors import FieldError
from kvscope.engine.serving.tool_parsers.forced import ANY_OBJECT, required_schema

ANY = None  # a no-op field whose every value changes nothing
# Fields kvscope accepts without acting on them, with the values at which that is true;
# any other value, and any field neither here nor declared below, is refused.
NO_OPS: dict[str, tuple[Any, ...] | None] = {
    "user": ANY, "safety_identifier": ANY, "metadata": ANY,  # labels for the caller
    "prompt_cache_key": ANY,  # prefix caching is automatic and keyed by the tokens
    "guided_decoding_backend": ANY,  # there is one backend: llguidance
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "functions": (None, []), "function_call": (None, "none"),  # the old names of tools
    "suffix": (None, ""),
    "spaces_between_special_tokens": (None, True),
    "include_stop_str_in_output": (None, False),
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "chat_template": (None,), "documents": (None, []),
    "mm_processor_kwargs": (None, {}), "modalities": (None, ["text"]),
    "logits_processors": (None, []),
    "return_tokens_as_token_ids": (None, False), "return_token_ids": (None, False),
}
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "structured_outputs")
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat share. `top_k`, `min_p`, `repetition_penalty`,
    `min_tokens`, `bad_words`, `allowed_token_ids`, `guided_*`... are vLLM's extensions."""

    model_config = ConfigDict(extra="allow")  # kept to be refused by name, see NO_OPS

    model: str | None = None
    # None: the model's generation_config default if it has one, else vLLM's.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    # vLLM's: lower is served first under --scheduling-policy priority. Any JSON value is
    # taken here so that the engine's refusal names the field and its range.
    priority: Any = 0
    # vLLM's: only requests of one salt share prefix-cache blocks. Any JSON value is taken
    # here so that the engine's refusal names the field.
    cache_salt: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def structured_field(self) -> str | None:
        """The request field that asked for structured output (errors name it)."""
        return next((name for name in STRUCTURED_FIELDS if getattr(self, name) is not None
                     and getattr(self, name) != {"type": "text"}), None)

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream=true")
        for name, value in (self.model_extra or {}).items():
            if name not in NO_OPS:
                raise FieldError(name, "kvscope does not implement this field, and "
                                 "refuses it rather than ignore it")
            allowed = NO_OPS[name]
            if allowed is not ANY and value not in allowed:
                raise ValueError(f"{name}={value!r} is not supported by kvscope")

    def sampling_params(self, defaults: dict, max_tokens: int | None, logprobs: int | None,
                        **more: Any) -> SamplingParams:
        """Validated SamplingParams (ValueError names the field). `defaults` are the model's
        (generation_config), used for the fields the request leaves out."""
        self.check_supported()
        given = {name: getattr(self, name) for name in
                 ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                 if getattr(self, name) is not None}
        if max_tokens is None and "max_tokens" in defaults:
            max_tokens = defaults["max_tokens"]
        return SamplingParams(
            **{**defaults, **given, "max_tokens": max_tokens}, n=self.n,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, bad_words=self.bad_words,
            allowed_token_ids=self.allowed_token_ids, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens, logprobs=logprobs,
            structured_outputs=self._structured_outputs(), **more)

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        field = self.structured_field
        if field is None:
            return None
        others = [name for name in STRUCTURED_FIELDS
                  if name != field and getattr(self, name) not in (None, {"type": "text"})]
        if others:
            raise ValueError(f"{others[0]}: give one structured-output field, not "
                             f"{field} and {', '.join(others)}")
        value = getattr(self, field)
        try:
            if field == "response_format":
                return _response_format(value)
            if field == "structured_outputs":
                unknown = [key for key in value if key not in STRUCTURED_OUTPUTS_KEYS]
                if unknown:
                    raise ValueError(f"{unknown[0]} is not supported; use one of "
                                     f"{', '.join(STRUCTURED_OUTPUTS_KEYS)}")
                return StructuredOutputsParams(**value)
            return StructuredOutputsParams(**{field.removeprefix("guided_"): value})
        except ValueError as error:
            message = str(error).removeprefix("structured_outputs: ")
            raise ValueError(f"{field}: {message}") from None


def _response_format(value: dict[str, Any]) -> StructuredOutputsParams:
    kind = value.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ValueError("json_schema.schema must be a JSON schema object")
        return StructuredOutputsParams(json=schema)
    raise ValueError(f"type={kind!r} is not supported; use text, json_object or json_schema")


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    prompt_logprobs: int | None = None
    add_special_tokens: bool = True
    # vLLM's beam search: best_of (else n) beams, the n best returned, best first.
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def prompts(self) -> list[str | list[int]]:
        """One engine prompt per entry: a string, or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise ValueError("prompt: give a string, a list of strings or token ids")
        return list(prompt)

    def to_params(self, defaults: dict) -> SamplingParams | BeamSearchParams:
        if self.use_beam_search:
            return self.beam_search_params(defaults)
        if self.length_penalty != 1.0:  # refused, not silently ignored
            raise ValueError("length_penalty: it scores beams; set use_beam_search=true")
        return self.to_sampling_params(defaults)

    def beam_search_params(self, defaults: dict) -> BeamSearchParams:
        if self.stream:
            raise ValueError("use_beam_search: beams are ranked only at the end, so beam "
                             "search cannot stream; set stream=false")
        if self.max_tokens is None:
            raise ValueError("max_tokens: required with use_beam_search")
        self.to_sampling_params(defaults)  # the other fields are checked all the same
        width = self.best_of if self.best_of is not None else self.n
        return BeamSearchParams(beam_width=width, max_tokens=self.max_tokens,
                                length_penalty=self.length_penalty,
                                ignore_eos=self.ignore_eos)

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ValueError(f"best_of={self.best_of}: the best of several samples is known "
                             "only at the end, so it cannot stream; set stream=false")
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = self.logprobs  # echoed prompt tokens carry logprobs too
        return self.sampling_params(defaults, self.max_tokens, self.logprobs,
                                    best_of=self.best_of, prompt_logprobs=prompt_logprobs)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


class ToolCallItem(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        for name in ("name", "tool_call_id"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        if self.tool_calls:
            # Templates index the arguments as a mapping, so they get the decoded object
            # (vLLM does the same).
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name,
                              "arguments": _decoded_arguments(call.function.arguments)}}
                for call in self.tool_calls]
        return message


def _decoded_arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        raise ValueError(f"messages: tool call arguments {arguments[:40]!r} are not "
                         "JSON") from None


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


def tools_for_template(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """The tools as a chat template reads them (OpenAI's shape), or None for no tools."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    tools: list[ChatTool] | None = None
    # None: "auto" with tools, "none" without (OpenAI's defaults).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens: int | None = None  # None: until the model stops or max_model_len
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    prompt_logprobs: int | None = None  # vLLM's: on the response, not on its choices
    add_special_tokens: bool = False  # the chat template holds the special tokens

    def conversation(self) -> list[dict[str, Any]]:
        return [message.as_template_input() for message in self.messages]

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        return tools_for_template(self.tools)

    def forced_tool_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must match for `required` or a named function."""
        choice = self.effective_tool_choice
        if choice in ("none", "auto"):
            return None
        if not self.tools:
            raise ValueError("tool_choice: requires tools; give the functions to call")
        functions = [tool.function.model_dump() for tool in self.tools]
        if choice == "required":
            return required_schema(functions, self.parallel_tool_calls)
        named = [f for f in functions if f["name"] == choice.function.name]
        if not named:
            raise ValueError(f"tool_choice: function {choice.function.name!r} is not among "
                             "the tools")
        return named[0]["parameters"] or ANY_OBJECT

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        max_tokens = (self.max_tokens if self.max_completion_tokens is None
                      else self.max_completion_tokens)
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: a chat chunk has no place for them, so they "
                             "are not available with stream=true (as in vLLM)")
        params = self.sampling_params(defaults, max_tokens,
                                      (self.top_logprobs or 0) if self.logprobs else None,
                                      prompt_logprobs=self.prompt_logprobs)
        schema = self.forced_tool_schema()
        if schema is not None:
            if params.structured_outputs is not None:
                raise ValueError(f"tool_choice: a forced tool call is already structured "
                                 f"output; leave out {self.structured_field}")
            params = dataclasses.replace(params,
                                         structured_outputs=StructuredOutputsParams(json=schema))
        return params
