"""Beam search inside the engine: beams are sequences that fork and share blocks."""

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


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
