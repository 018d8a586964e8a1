"""SamplingParams: how one request samples and when it stops, validated on construction."""

import math
from dataclasses import dataclass, field, fields


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's structured-output request: exactly one of these constrains the output."""

    json: str | dict | None = None  # a JSON schema (dict or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark syntax (llguidance's dialect)
    json_object: bool | None = None  # any JSON object
    # The constraint holds from the end of this text on (a reasoning model's "</think>",
    # as vLLM's reasoning parsers do); the output before it is free. None: from the start.
    start_after: str | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self)
                 if f.name != "start_after" and getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of json, regex, choice, "
                             f"grammar, json_object (got {given or 'none'})")
        if self.choice is not None and (
                not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice: must be a non-empty list of strings")

        if self.start_after is not None and not (isinstance(self.start_after, str)
                                                 and self.start_after):
            raise ValueError("structured_outputs.start_after: must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self)
                    if f.name != "start_after" and getattr(self, f.name) not in (None, False))


@dataclass(slots=True)
class SamplingParams:
    """vLLM's sampling knobs, names and defaults (temperature 1.0, top_p 1.0, max_tokens 16)."""

    n: int = 1
    best_of: int | None = None  # sample best_of, return the n with the highest logprob
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no cap
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: False leaves the output's text empty (token ids only); the replay simulator,
    # whose tokens are placeholders, saves the tokenizer's time with it.
    detokenize: bool = True
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_int(self.n, "n", 1)
        if self.best_of is not None:
            _check_int(self.best_of, "best_of", 1)
            if self.best_of < self.n:
                raise ValueError(f"best_of={self.best_of} must be >= n={self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name}={getattr(self, name)!r} must be in [-2, 2]")
        if not _number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} must be > 0")
        # `not >= 0` also refuses NaN, which would turn every probability into NaN.
        if not _number(self.temperature) or not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be -1, 0 (no cap) or >= 1")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p!r} must be in [0, 1]")
        if self.max_tokens is not None:
            _check_int(self.max_tokens, "max_tokens", 1)
        _check_int(self.min_tokens, "min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= "
                             f"max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= 20):
                raise ValueError(f"{name}={value!r} must be between 0 and 20")
        # torch.Generator takes a 64-bit seed; vLLM bounds the field to int64 as here.
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**63):
            raise ValueError(f"seed={self.seed!r} must be an integer in [-2**63, 2**63 - 1]")
        if self.truncate_prompt_tokens is not None:
            _check_int(self.truncate_prompt_tokens, "truncate_prompt_tokens", 1)
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop={self.stop!r} must be non-empty strings")
        self.stop_strings = tuple(stops)
        if not isinstance(self.detokenize, bool):
            raise ValueError(f"detokenize={self.detokenize!r} must be True or False")
        if stops and not self.detokenize:
            raise ValueError("stop: stop strings are matched in the text; they need "
                             "detokenize=True")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words or []):
            raise ValueError(f"bad_words={self.bad_words!r} must be non-empty strings")
        self.logit_bias = _token_bias(self.logit_bias)
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or
                any(isinstance(t, bool) or not isinstance(t, int) for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids={self.allowed_token_ids!r} must be a non-empty "
                             "list of token ids")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)

    def to_dict(self) -> dict:
        """Every field, as JSON-ready values (the session log keeps them for a replay)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.init}

    @classmethod
    def from_dict(cls, values: dict) -> "SamplingParams":
        """The params to_dict() wrote; fields a newer version wrote are refused by name."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"sampling params: unknown field(s) {unknown}")
        return cls(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_sequences(self) -> int:
        """How many sequences run: best_of when set (the best n are returned), else n."""
        return self.best_of or self.n

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def _plain(value):
    if isinstance(value, StructuredOutputsParams):
        return {f.name: getattr(value, f.name) for f in fields(value)
                if getattr(value, f.name) not in (None, False)}
    if isinstance(value, dict):  # logit_bias: JSON keys are strings; from_dict parses them
        return {str(key): item for key, item in value.items()}
    return list(value) if isinstance(value, tuple) else value


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(value, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


def _token_bias(bias) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON keys (strings); biases are clamped to [-100, 100]."""
    if not bias:
        return None
    try:
        parsed = {int(token): float(value) for token, value in bias.items()}
    except (TypeError, ValueError, AttributeError):
        raise ValueError(f"logit_bias={bias!r} must map token ids to numbers") from None
    if any(not math.isfinite(value) for value in parsed.values()):
        raise ValueError(f"logit_bias={bias!r}: biases must be finite numbers")
    return {token: min(max(value, -100.0), 100.0) for token, value in parsed.items()}


# generation_config.json keys vLLM reads as the model's sampling defaults, and our names.
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                          "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                          "max_new_tokens": "max_tokens"}


def model_sampling_defaults(generation_config) -> dict:
    """The sampling fields a model's generation_config sets explicitly (vLLM's
    `generation_config="auto"`): they replace vLLM's defaults where a request is silent."""
    explicit = generation_config.to_diff_dict() if generation_config is not None else {}
    return {ours: explicit[theirs] for theirs, ours in GENERATION_CONFIG_KEYS.items()
            if explicit.get(theirs) is not None}
