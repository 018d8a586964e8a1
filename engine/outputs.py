"""Output records shaped like vLLM's: RequestOutput holding one CompletionOutput per sample."""

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: str | int | None = None  # the stop string or token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.time()) of the request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(slots=True)
class KVCost:
    """What a request cost the KV cache (kvscope's own; vLLM has no such field). Blocks
    are block table entries summed over the request's samples, counted on the steps that
    scheduled it."""

    blocks_peak: int = 0  # the most blocks it held in one step
    block_seconds: float = 0.0  # blocks held x the seconds of each step that ran it
    tokens_recomputed: int = 0  # computed tokens preemptions threw away, computed again
    # Where its prompt's K/V came from: the prefix cache (whole blocks, as
    # usage.prompt_tokens_details.cached_tokens counts them), or computed by its steps
    # (prompt and output tokens, recomputed ones included).
    prefix_cached_tokens: int = 0
    computed_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Beside prompt_logprobs: each prompt token's rank among all tokens at its position.
    prompt_token_ranks: list[int | None] | None = None
    # Per sample, the text added since the previous output of this request (for streaming).
    deltas: list[str] = field(default_factory=list)
    kv: KVCost | None = None  # its KV cost so far (None: a replica's or a past output)
