"""Request / Sequence state: token ids, status, timings and the block table.

A leaf: every stage reads these records, so this module imports no other part of the engine
but the sampling params. What the stages above the core keep on a request (a beam search's
state, compiled logit edits, speculative acceptance) is typed here as the plain `object`
they own; the core never reads it.
"""

import enum
import time
from dataclasses import dataclass, field

import torch

from kvscope.engine.sampling_params import SamplingParams

# Identity of a full block's content, (value, parent, token_ids): value hashes the tokens
# chained to the parent's value, so a hit means the whole prefix matches. A plain tuple of
# bytes and ints, not a dataclass: Python's garbage collector stops tracking such a tuple
# at its first pass, while every full collection walks each dataclass instance, on
# whichever thread (docs/performance-history.md, 'Figures the code's comments quoted').
BlockHash = tuple[bytes, bytes | None, tuple[int, ...]]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no device blocks
    RUNNING = "running"  # holds device blocks
    SWAPPED = "swapped"  # queued; its K/V sits in the CPU swap pool
    FINISHED = "finished"


class ChunkKind(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class FinishReason(enum.StrEnum):
    """Why a sequence ended; a str, so outputs and logs keep vLLM's plain strings."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    BEAM_DROPPED = "beam_dropped"  # a beam that fell out of the top beam_width


@dataclass(slots=True, eq=False)
class Sequence:
    """One token stream with its own block table; a request holds `n` of them."""

    seq_id: str
    request: "Request"
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    # Block ids by position, each KV cache group's table interleaved (entry
    # i * num_groups + g: group g's block for position block i; one group: the plain
    # table); RELEASED (kv_cache_manager) where a sliding window freed one.
    block_table: list[int] = field(default_factory=list)
    swap_table: list[int] = field(default_factory=list)  # CPU blocks while swapped out
    num_released_blocks: int = 0  # positions whose sliding groups' entries are RELEASED
    # The recurrent layers' state slot (engine.core.state_slots) while the sequence holds
    # device blocks; None for a model without recurrent layers.
    state_slot: int | None = None
    num_computed_tokens: int = 0
    # 1 while a launched step will append this sequence's next token (vLLM's name): with
    # async scheduling the next step is scheduled before that token is known.
    num_output_placeholders: int = 0
    # Content hashes of the full blocks of token_ids, in order, each computed once
    # (prefix-cache lookups and registration read them); the first num_cached_blocks of
    # the block table are registered in the pool's cache.
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_blocks: int = 0
    # Speculative decoding (engine.spec_decode): the tokens proposed to follow token_ids,
    # verified by the next step, and how this sequence's proposals have fared.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_stats: object | None = None  # spec_decode.proposer.SpecAcceptance
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    # Output text, detokenized incrementally (see kvscope.engine.orchestrator.detokenizer).
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    num_emitted_chars: int = 0  # text already handed out in streaming deltas
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def reaches_length_limit(self, max_model_len: int, num_more: int = 0) -> bool:
        """Whether the sequence, `num_more` tokens on, is at max_model_len or max_tokens
        (never below min_tokens: SamplingParams keeps min_tokens <= max_tokens)."""
        max_tokens = self.request.params.max_tokens
        return (self.num_tokens + num_more >= max_model_len
                or max_tokens is not None and self.num_output_tokens + num_more >= max_tokens)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def priority_key(self) -> tuple[int, float]:
        """Larger is less important: served later, preempted first (vLLM: higher priority
        value, later arrival; the rank adds aging, see engine.core.scheduling_policy)."""
        return (self.request.rank, self.request.arrival_time)


@dataclass(slots=True, eq=False)
class Request:
    """What a caller asked for: one prompt, its sampling params and its sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0  # lower is served first under scheduling_policy="priority"
    # vLLM's: mixed into the first block's hash, so only requests of one salt share a prefix.
    cache_salt: str | None = None
    rank: int = 0  # its aged place in line, given on arrival (engine.core.scheduling_policy)
    source: str = "api"
    sequences: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    aborted: bool = False
    # Set for beam search (orchestrator.beam_search.BeamState): its sequences are the beams.
    beam: object | None = None
    # Compiled logit edits and grammar (sample.logits_processing.RequestConstraints).
    constraints: object | None = None
    # With params.prompt_logprobs: None for the first prompt token, then one entry per
    # prompt token (its logprob and the top alternatives), filled as prefill chunks run.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] | None = None  # each prompt token's rank, alongside

    @property
    def finished(self) -> bool:
        # A loop, not all() over a generator: read for every request each step it samples.
        for seq in self.sequences:
            if seq.status is not SequenceStatus.FINISHED:
                return False
        return True

    @property
    def num_pending_forks(self) -> int:
        """Sequences still to fork from the first once its first token is sampled: the other
        n - 1 samples of the prompt (a beam search forks its beams as it ranks them)."""
        if self.beam is not None or len(self.sequences) != 1:
            return 0
        return self.params.num_sequences - 1
