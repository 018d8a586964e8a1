"""The workload record: what every replay source (a trace, a recorded session) becomes."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvscope.engine.orchestrator.beam_search import BeamSearchParams
from kvscope.engine.sampling_params import SamplingParams

# Fields that change what a sample's tokens are but neither its length nor what the
# scheduler does; the simulator, which picks placeholder tokens, runs without them.
TOKEN_CHOICE_FIELDS = ("structured_outputs", "logit_bias", "allowed_token_ids", "bad_words",
                       "logprobs", "prompt_logprobs")
LOG_SUFFIXES = (".db", ".sqlite", ".sqlite3")  # kvscope's own session logs


@dataclass(slots=True)
class ReplayRequest:
    """One request to run again: its prompt, when it arrives and how long its output is."""

    request_id: str
    arrival_s: float  # seconds after the workload's first arrival
    prompt_token_ids: list[int]
    num_output_tokens: int  # per sample: the replay forces this length
    # SamplingParams.to_dict() ({} = defaults), or BeamSearchParams.to_dict() for a beam search
    sampling: dict = field(default_factory=dict)
    # The first sample's recorded tokens, when the source kept them (kvscope's own log).
    recorded_output_token_ids: list[int] | None = None
    # Its priority (lower first) where the trace gives one: honoured by a replay under
    # scheduling_policy="priority", so fcfs and priority compare on one trace.
    priority: int = 0

    @property
    def beam_search(self) -> bool:
        return "beam_width" in self.sampling

    def params(self, simulated: bool = False) -> SamplingParams | BeamSearchParams:
        """The recorded sampling with the output forced to its recorded length: EOS and
        stop conditions ignored, max_tokens the recorded count (greedy and seeded requests
        then reproduce their recorded tokens under the recorded config). A beam search runs
        as one again, its beams forced to the recorded length."""
        if self.beam_search:
            if simulated:
                raise ValueError(
                    f"request {self.request_id}: beam search (beam_width="
                    f"{self.sampling['beam_width']}): a simulated "
                    "replay has no logits to rank beams by; replay it live")
            return BeamSearchParams(**{**self.sampling, "max_tokens": self.num_output_tokens,
                                       "ignore_eos": True})
        values = {**self.sampling, "max_tokens": self.num_output_tokens, "ignore_eos": True,
                  "stop": None, "stop_token_ids": None,
                  "min_tokens": min(self.sampling.get("min_tokens", 0), self.num_output_tokens)}
        if simulated:  # placeholder tokens: nothing to constrain, no text worth decoding
            for name in TOKEN_CHOICE_FIELDS:
                values.pop(name, None)
            values["detokenize"] = False
        return SamplingParams.from_dict(values)


@dataclass(slots=True)
class Workload:
    """Requests in arrival order; a recorded session also brings the config it ran under."""

    name: str
    requests: list[ReplayRequest]
    config: dict | None = None  # the recorded engine config (kvscope's log), else None
    # Steps of the recorded run (kvscope's log): a step-cost model can be fitted to them.
    steps: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError(f"{self.name}: the workload has no requests")
        self.requests.sort(key=lambda request: request.arrival_s)
        first = self.requests[0].arrival_s
        for request in self.requests:
            request.arrival_s -= first


def is_session_log(path: Path) -> bool:
    return path.suffix.lower() in LOG_SUFFIXES


class SessionLogReader(Protocol):
    """Reads kvscope's own SQLite session logs as replay input. The log belongs to storage,
    above the engine: kvscope.storage.replay_source is the reader, and the command line and
    the Compare tab hand it to the replay."""

    def load_session_workload(self, path: str | Path, session_id: int | None = None,
                              model: str | None = None) -> Workload: ...

    def load_logged_steps(self, path: str | Path, session_id: int | None = None) -> list: ...
