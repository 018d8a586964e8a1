"""Request bodies of the OpenAI-compatible API, and their translation to SamplingParams."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling_params import SamplingParams

# OpenAI fields kvscope does not implement, accepted only at values that change nothing;
# anything else is refused rather than silently ignored.
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat share; `top_k`, `ignore_eos`, `stop_token_ids` are vLLM's
    extensions (the openai client sends them with `extra_body`)."""

    # Unknown fields (user, metadata, store...) are allowed and ignored, as OpenAI's are.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        for name, no_op in NO_OP_VALUES.items():
            value = (self.model_extra or {}).get(name)
            if value not in no_op:
                raise ValueError(f"{name}={value!r} is not supported by kvscope")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Validated SamplingParams (ValueError names the field)."""
        self.check_supported()
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=self.seed, max_tokens=max_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """One engine prompt per entry: a string, or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise ValueError("prompt: give a string, a list of strings or token ids")
        return list(prompt)

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: until the model stops or max_model_len
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def conversation(self) -> list[dict[str, str]]:
        return [message.as_template_input() for message in self.messages]

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = (self.max_tokens if self.max_completion_tokens is None
                      else self.max_completion_tokens)
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs
                                    else None)
