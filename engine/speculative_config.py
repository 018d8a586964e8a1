"""SpeculativeConfig: vLLM's `speculative_config` fields, validated on construction."""

from dataclasses import asdict, dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
MAX_PROMPT_LOOKUP = 64


@dataclass(slots=True)
class SpeculativeConfig:
    """How proposals are made and how many a step verifies.

    ngram: prompt lookup, the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens (prompt_lookup_max >= n >= prompt_lookup_min) in its own prompt
    and output.
    draft_model: `model`, a smaller model on the target's vocabulary, proposes k tokens one
    forward each, with its own paged KV (engine.spec_decode.draft_model).
    As in vLLM, `method` left out means draft_model when a `model` is given, else ngram.
    """

    method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    # vLLM's knob: no proposals while more than this many sequences run (the forward is
    # then compute-bound, and verifying proposals costs what they would save). None: never.
    disable_by_batch_size: int | None = 8
    # A sequence whose proposals were accepted less than this share of the time (over its
    # recent drafts) stops proposing for a while: a workload that cannot gain must not lose.
    min_acceptance_rate: float = 0.2
    # Each step, cut proposals to the tokens whose chance of acceptance pays for the rows
    # they add, by the step cost measured on the steps run (engine.spec_decode.step_cost).
    # num_speculative_tokens is then each sequence's most. False: always propose it.
    adaptive_k: bool = True

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "ngram" if self.model is None else "draft_model"
        _check_choice("method", self.method, METHODS)
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1,
                   MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, MAX_PROMPT_LOOKUP)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, MAX_PROMPT_LOOKUP)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} "
                             f"must be <= prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f"speculative_config.model={self.model!r}: method='ngram' takes "
                             "no model; a draft model is for method='draft_model'")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative_config.model={self.model!r}: method='draft_model' "
                             "needs the path or name of a draft model")
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1, None)
        if not isinstance(self.adaptive_k, bool):
            raise ValueError(f"speculative_config.adaptive_k={self.adaptive_k!r} must be "
                             "true or false")
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ValueError(f"speculative_config.min_acceptance_rate={rate!r} must be in "
                             "[0, 1]")

    @classmethod
    def from_value(cls, value: "SpeculativeConfig | dict[str, Any] | None"
                   ) -> "SpeculativeConfig | None":
        """A config from a dict (as vLLM takes it, or parsed from --speculative-config JSON);
        unknown fields are refused by name."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config={value!r} must be a dict of "
                             f"{[f.name for f in fields(cls)]} or None")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: "
                             f"{sorted(known)}")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"speculative_config.{name}={value!r} must be one of {list(choices)}")


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    if (isinstance(value, bool) or not isinstance(value, int) or value < low
            or (high is not None and value > high)):
        limit = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ValueError(f"speculative_config.{name}={value!r} must be an integer {limit}")
