"""SamplingParams: how one request samples and when it stops, validated on construction."""

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """vLLM's sampling knobs and defaults (temperature 1.0, top_p 1.0, max_tokens 16)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no cap
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be an integer >= 1")
        # `not >= 0` also refuses NaN, which would turn every probability into NaN.
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be -1, 0 (no cap) or >= 1")
        if self.max_tokens is not None and (
                not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if self.logprobs is not None and (
                not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs={self.logprobs!r} must be between 0 and 20")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an integer")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop={self.stop!r} must be non-empty strings")
        self.stop_strings = tuple(stops)
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
