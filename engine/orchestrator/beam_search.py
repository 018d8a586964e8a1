"""Beam search above the scheduler: beams are ordinary sequences that fork and share blocks.

The scheduler runs each beam like any sequence. When a beam's step samples, the
coordinator ranks its continuations and detaches it from the scheduler; once every live
beam of the request has ranked, it advances the search in one go: forks of the chosen
parents, their new tokens, and finishes for the dropped ones. The beams then rejoin the
scheduler with one token each to compute.
"""

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from kvscope.engine.core.request import FinishReason, Request, Sequence
from kvscope.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvscope.engine.core.scheduler import Scheduler


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's beam-search knobs; scores are cumulative logprob / generated_len ** penalty."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) \
                or self.beam_width < 1:
            raise ValueError(f"beam_width={self.beam_width!r} must be an integer >= 1")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")

    def to_dict(self) -> dict:
        """Every field (the session log keeps them: `beam_width` tells a replay that the
        request was a beam search, not a sampling)."""
        return asdict(self)

    def sampling_params(self) -> SamplingParams:
        """What each beam obeys as a sequence (stopping); the choice of tokens is the beam's."""
        return SamplingParams(temperature=0, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos)


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its generated tokens and their cumulative logprob."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float


@dataclass(slots=True)
class BeamState:
    params: BeamSearchParams
    finished: list[Hypothesis] = field(default_factory=list)
    # Per live beam (by seq_id): the best (token, logprob) continuations of its last step.
    candidates: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    num_forks: int = 0  # names new beams uniquely
    done: bool = False

    def score(self, cumulative_logprob: float, num_generated: int) -> float:
        return cumulative_logprob / (num_generated ** self.params.length_penalty)

    def add_finished(self, token_ids: list[int], cumulative_logprob: float) -> None:
        self.finished.append(Hypothesis(
            token_ids, cumulative_logprob, self.score(cumulative_logprob, len(token_ids))))
        if len(self.finished) >= self.params.beam_width:
            self.done = True  # early stopping, as transformers' early_stopping=True

    def best(self) -> list[Hypothesis]:
        return sorted(self.finished, key=lambda h: h.score, reverse=True)[:self.params.beam_width]


@dataclass(slots=True)
class BeamChoice:
    """The next step's beams: (parent seq_id, token, new cumulative logprob)."""

    continue_with: list[tuple[str, int, float]]
    # How many of continue_with (a prefix: they are in rank order) rank among the top width
    # candidates; at the length limit only those may finish, as in transformers.
    num_top_ranked: int = 0


def choose_beams(
    state: BeamState, beams: dict[str, tuple[float, list[int]]], eos_token_ids: set[int]
) -> BeamChoice:
    """Rank every live beam's continuations by cumulative logprob (transformers' rule: the
    top 2 x width candidates; an EOS among the top width finishes a hypothesis; the best
    width non-EOS candidates continue).

    `beams` maps seq_id -> (cumulative logprob, generated token ids so far).
    """
    width = state.params.beam_width
    ranked = sorted(
        ((cumulative + logprob, seq_id, token)
         for seq_id, (cumulative, _) in beams.items()
         for token, logprob in state.candidates[seq_id]),
        key=lambda c: c[0], reverse=True)[:2 * width]
    chosen = []
    num_top_ranked = 0
    for rank, (score, seq_id, token) in enumerate(ranked):
        if token in eos_token_ids and not state.params.ignore_eos:
            if rank < width:
                state.add_finished(beams[seq_id][1] + [token], score)
        elif len(chosen) < width:
            chosen.append((seq_id, token, score))
            num_top_ranked += rank < width
    state.candidates.clear()
    return BeamChoice(chosen, num_top_ranked)


class SequenceUpdates(Protocol):
    """The engine's single path for changing sequences after a step."""

    eos_token_ids: set[int]

    def fork(self, parent: Sequence, index: int) -> Sequence: ...

    def append_token(self, seq: Sequence, token: int, logprob: float) -> None: ...

    def finish(self, seq: Sequence, reason: FinishReason) -> None: ...


class BeamSearchCoordinator:
    """Turns each beam step into ordinary sequence updates; the scheduler knows no beams."""

    def __init__(self, scheduler: "Scheduler", max_model_len: int) -> None:
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        # Beams that ranked their continuations and await their siblings': they keep
        # their blocks but are out of the scheduler, in the order they parked.
        self.parked: list[Sequence] = []

    def rank(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Keep a sampled beam's best continuations and park it until its siblings rank."""
        state = seq.request.beam
        values, ids = torch.log_softmax(logits, dim=-1).topk(2 * state.params.beam_width)
        state.candidates[seq.seq_id] = list(zip(ids.tolist(), values.tolist()))
        self.scheduler.detach(seq)
        self.parked.append(seq)

    def ready(self, request: Request) -> bool:
        """Every live beam has ranked: the search can take its next step."""
        return all(seq.seq_id in request.beam.candidates
                   for seq in request.sequences if not seq.is_finished)

    def advance(self, request: Request, updates: SequenceUpdates) -> int:
        """One beam step: fork the chosen parents, extend them, drop the rest; returns the
        number of tokens appended."""
        state = request.beam
        live = {seq.seq_id: seq for seq in request.sequences if not seq.is_finished}
        self.parked = [seq for seq in self.parked if seq.request is not request]
        choice = choose_beams(
            state, {i: (s.cumulative_logprob, s.output_token_ids) for i, s in live.items()},
            updates.eos_token_ids)
        # Fork before any parent grows: a child must copy the parent's history only.
        extended: list[tuple[Sequence, int, float]] = []
        for parent_id, token, score in choice.continue_with:
            parent = live[parent_id]
            if any(seq is parent for seq, _, _ in extended):
                state.num_forks += 1
                parent = updates.fork(parent, state.num_forks)
            extended.append((parent, token, score))
        kept = {seq.seq_id for seq, _, _ in extended}
        for seq in live.values():
            if seq.seq_id not in kept:
                updates.finish(seq, FinishReason.BEAM_DROPPED)
                request.sequences.remove(seq)
        for seq, token, score in extended:
            updates.append_token(seq, token, score - seq.cumulative_logprob)
        out_of_room = any(seq.num_output_tokens >= state.params.max_tokens
                          or seq.num_tokens >= self.max_model_len
                          for seq, _, _ in extended)
        if state.done or out_of_room or not extended:
            # Out of room: the live beams compete with the finished ones, even when an EOS
            # filled the list in this same step (transformers merges both at once).
            if out_of_room:
                for seq, _, _ in extended[:choice.num_top_ranked]:
                    state.add_finished(seq.output_token_ids, seq.cumulative_logprob)
            for seq, _, _ in extended:
                updates.finish(seq, FinishReason.LENGTH)
            state.done = True
        else:  # the parked parents rejoin the scheduler (forks joined when made)
            for seq, _, _ in extended:
                if seq.seq_id in live:
                    self.scheduler.resume(seq)
        return len(extended)

    def release_parked(self) -> Sequence | None:
        """The scheduler's reclaim hook: free the device blocks of one parked beam (the
        least important, latest parked first), which recomputes when its search goes on
        (the scheduler records what it loses and resets its computed tokens).
        Idle beams give up memory before anything that computes, so a beam blocked on
        memory can never wait for siblings that hold it. None if no parked beam has any."""
        holders = [seq for seq in self.parked if seq.block_table]
        if not holders:
            return None
        victim = max(reversed(holders), key=lambda s: s.priority_key)
        self.scheduler.kv_cache.free(victim)
        return victim

    def forget(self, request: Request) -> None:
        """The request ended (finished or aborted): drop its parked beams."""
        self.parked = [seq for seq in self.parked if seq.request is not request]
