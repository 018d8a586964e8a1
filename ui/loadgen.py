"""The load generator: N requests at a rate, sharing a system prompt, to stress the pool."""

import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvscope.engine.config import EngineConfig
from kvscope.engine.entrypoints.view import EngineView
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.memory import MemoryPlan

# Ordinary prose to cut prompts from, so block hover texts read as words.
CORPUS = (
    "The paged attention design stores the key and value cache of every sequence in "
    "fixed size blocks, so memory is allocated on demand and shared between requests "
    "that start with the same tokens. A block table maps each logical block of a "
    "sequence to a physical block in the pool, much like virtual memory maps pages. "
    "When the pool runs out, the scheduler preempts the least important request and "
    "recomputes it later, while prefix caching keeps finished prompts around until "
    "their blocks are needed again. ")
MAX_WORKERS = 64  # streams drained at once, per run
# A slow run waits between its sends in steps this long, so it notices a stopped engine
# (and its threads end) within one step rather than at its next send time.
ENGINE_CHECK_S = 0.5
logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadSpec:
    num_requests: int
    rate: float  # requests per second
    shared_fraction: float  # share of requests that start with the shared system prompt
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    n: int = 1

    def validate(self, max_model_len: int) -> None:
        """Refuse before anything is sent what the engine would refuse per request."""
        # :g, so a value typed as 1e308 is echoed as typed, not as 309 digits
        if not 1 <= self.num_requests <= 1000:
            raise ValueError(f"requests={self.num_requests:g} must be between 1 and 1000")
        if not 0 < self.rate <= 1000:
            raise ValueError(f"rate={self.rate:g} must be in (0, 1000] requests/s")
        if not 0 <= self.shared_fraction <= 1:
            raise ValueError(f"shared fraction={self.shared_fraction:g} must be in [0, 1]")
        for name, (low, high) in (("prompt", self.prompt_len), ("output", self.output_len)):
            if not 1 <= low <= high:
                raise ValueError(f"{name} tokens min {low:g} and max {high:g}: need "
                                 "1 <= min <= max")
        if not 1 <= self.n <= 8:
            raise ValueError(f"n={self.n:g} must be between 1 and 8")
        longest = self.prompt_len[1] + self.output_len[1]
        if longest > max_model_len:
            raise ValueError(f"prompt tokens max {self.prompt_len[1]:g} + output tokens max "
                             f"{self.output_len[1]:g} = {longest:g} is more than the engine's "
                             f"max_model_len={max_model_len}: lower them")


# The default load asks for this many times the pool's token slots, so it shows what the
# tab promises (a full pool: eviction of cached prefixes, then preemption).
DEFAULT_POOL_FILL = 1.5


def default_spec(engine: EngineView) -> LoadSpec:
    """A load sized to this engine's pool and max_model_len."""
    return default_spec_for(engine.memory_plan)


def default_spec_for(plan: MemoryPlan, fill: float = DEFAULT_POOL_FILL,
                     rate: float = 8.0) -> LoadSpec:
    """Requests asking for `fill` x the pool's token slots in all."""
    spec = LoadSpec(0, rate, 0.5, _prompts(plan, 0.5), _outputs(plan, 0.5))
    per_request = (sum(spec.prompt_len) + sum(spec.output_len)) / 2
    spec.num_requests = min(max(int(fill * plan.num_tokens / per_request), 32), 1000)
    return spec


@dataclass(frozen=True, slots=True)
class Scenario:
    """A one-click load with a caption saying what to watch."""

    name: str
    caption: str
    spec: Callable[[MemoryPlan, EngineConfig], LoadSpec]


LONG_PROMPT_OUTPUT_TOKENS = 8


def _long_prompt(plan: MemoryPlan, config: EngineConfig) -> LoadSpec:
    """A prompt of two and a half step budgets: three prefill chunks at whatever
    max_num_batched_tokens the engine runs now, or a refusal saying which knob stops it."""
    budget = config.max_num_batched_tokens
    if not config.enable_chunked_prefill:
        raise ValueError("A long prompt, chunked needs chunked prefill: tick \"chunked "
                         "prefill\" in the Engine & load tab and Apply")
    room = plan.max_model_len - LONG_PROMPT_OUTPUT_TOKENS
    if room <= budget:
        raise ValueError(
            f"A long prompt, chunked needs a prompt longer than one step's "
            f"max_num_batched_tokens={budget}, but max_model_len={plan.max_model_len} leaves "
            f"room for {room} prompt tokens: set max_num_batched_tokens below {room} in the "
            "Engine & load tab and Apply")
    length = min(2 * budget + budget // 2, room)
    return LoadSpec(1, 1.0, 0.0, (length, length), (LONG_PROMPT_OUTPUT_TOKENS,) * 2)


SCENARIOS = (
    Scenario("Shared system prompt",
             "Every request starts with the same system prompt. Watch the prefix tree grow "
             "one trunk, the heatmap's shared (amber) blocks, the block tables' first "
             "columns repeat one block id in every row, and the event log's prefix hits.",
             lambda plan, config: LoadSpec(16, 4.0, 1.0, _prompts(plan, 0.5),
                                           _outputs(plan, 0.5))),
    Scenario("Pool pushed into preemption",
             "More long requests than the pool holds at once. Watch the heatmap fill, "
             "cached blue blocks evicted first, then red preemptions in the timeline and "
             "the event log, and the waiting line in the series climb.",
             lambda plan, config: default_spec_for(plan, fill=2.0, rate=50.0)),
    Scenario("Parallel sampling (n=4)",
             "Each request samples 4 continuations of one prompt. Watch its 4 sequences share the "
             "prompt's blocks (ref count 4, dark amber) until each writes its own last "
             "block: copy-on-write. The summary counts 4 sequences per request.",
             lambda plan, config: LoadSpec(4, 2.0, 0.0, _prompts(plan, 0.5),
                                           _outputs(plan, 0.5), 4)),
    Scenario("A long prompt, chunked",
             "One prompt of two and a half step budgets (max_num_batched_tokens), so chunked "
             "prefill computes it in three steps: watch its timeline row's prefill chunks, "
             "its block table grow chunk by chunk, and the summary count it running "
             "meanwhile.",
             _long_prompt),
)


def _prompts(plan: MemoryPlan, share: float) -> tuple[int, int]:
    high = max(min(int(plan.max_model_len * share), 1024), 2)
    return high // 4, high


def _outputs(plan: MemoryPlan, share: float) -> tuple[int, int]:
    room = plan.max_model_len - _prompts(plan, share)[1]
    return min(16, room), min(256, room)


@dataclass(slots=True)
class LoadRun:
    """One press of "Send load": its own counters, so runs do not add up."""

    number: int
    spec: LoadSpec
    started: float = field(default_factory=time.monotonic)
    sent: int = 0
    finished: int = 0
    aborted: int = 0  # ended by an abort (Apply with "abort running requests", a shutdown)
    failed: int = 0
    ended: float | None = None
    error: str | None = None  # why the sending thread stopped early

    def describe(self) -> str:
        done = self.finished + self.aborted + self.failed
        elapsed = (self.ended or time.monotonic()) - self.started
        state = "done" if self.ended else "running"
        line = (f"run {self.number} ({state}, {elapsed:.0f} s): sent {self.sent} of "
                f"{self.spec.num_requests} · finished {self.finished} · aborted "
                f"{self.aborted} · refused or failed {self.failed} · in flight "
                f"{self.sent - done}")
        return line + (f" · **stopped sending: {self.error}**" if self.error else "")


class LoadGenerator:
    """Sends in a background thread; counts per run what was sent, finished, refused or
    failed."""

    def __init__(self, engine: EngineView):
        self.engine = engine
        self.runs: list[LoadRun] = []
        self.refusal: str | None = None  # the last "Send load" refused, until one is sent
        self._lock = threading.Lock()
        corpus_ids = engine.tokenizer(CORPUS * 8, add_special_tokens=False).input_ids
        self._corpus = corpus_ids
        self._system = corpus_ids[:len(corpus_ids) // 4]

    def status(self) -> str:
        """The progress line the page polls; a refused "Send load" stays on top of it
        until a run is sent, so the poll never hides why nothing was sent."""
        with self._lock:
            lines = [f"**Load not sent:** {self.refusal}"] if self.refusal else []
            if not self.runs:
                lines.append("load generator: no run yet")
            else:
                lines.append(f"**load generator** {self.runs[-1].describe()}")
            if len(self.runs) > 1:
                lines.append(f"earlier: {self.runs[-2].describe()}")
            return "  \n".join(lines)

    def start_scenario(self, name: str) -> str:
        """Send a guided scenario's load; its caption says what to watch."""
        scenario = next((s for s in SCENARIOS if s.name == name), None)
        if scenario is None:
            raise ValueError(f"scenario={name!r} must be one of {[s.name for s in SCENARIOS]}")
        self.start(scenario.spec(self.engine.memory_plan, self.engine.config))
        return f"**{scenario.name}** — {scenario.caption}"

    def refuse(self, reason: str) -> None:
        """Keep why a "Send load" was not sent, for status()."""
        with self._lock:
            self.refusal = reason

    def start(self, spec: LoadSpec, seed: int | None = None) -> str:
        """Send a run in the background, or raise ValueError (kept for status()) naming
        the setting that cannot be sent."""
        try:
            spec.validate(self.engine.memory_plan.max_model_len)
        except ValueError as error:
            self.refuse(str(error))
            raise
        with self._lock:
            self.refusal = None
            run = LoadRun(len(self.runs) + 1, spec)
            self.runs.append(run)
        threading.Thread(target=self._send_all, args=(run, random.Random(seed)),
                         name="kvscope-loadgen", daemon=True).start()
        return (f"Sending {spec.num_requests} requests at {spec.rate:g}/s "
                f"({spec.shared_fraction:.0%} with the shared system prompt).")

    def prompt(self, spec: LoadSpec, rng: random.Random) -> list[int]:
        """Prose cut from the corpus, read round and round so any length can be had."""
        length = rng.randint(*spec.prompt_len)
        prefix = self._system[:length] if rng.random() < spec.shared_fraction else []
        start = rng.randrange(len(self._corpus))
        rest = length - len(prefix)
        laps = -(-(start + rest) // len(self._corpus))
        return prefix + (self._corpus * laps)[start:start + rest]

    def _send_all(self, run: LoadRun, rng: random.Random) -> None:
        """Whatever stops the sending early is kept on the run, for the status line."""
        try:
            self._send_each(run, rng)
        except Exception as error:  # noqa: BLE001 -- shown on the page, not lost in a thread
            logger.exception("load run %d stopped", run.number)
            with self._lock:
                run.error = f"{type(error).__name__}: {error}"
                run.ended = time.monotonic()

    def _send_each(self, run: LoadRun, rng: random.Random) -> None:
        """The run's streams are drained by its own pool, which ends with the run: no
        thread of the load generator outlives its last stream."""
        spec, started = run.spec, run.started
        with ThreadPoolExecutor(MAX_WORKERS, thread_name_prefix="kvscope-loadgen") as pool:
            for index in range(spec.num_requests):
                self._wait_until(started + index / spec.rate)
                params = SamplingParams(n=spec.n, temperature=1.0, ignore_eos=True,
                                        max_tokens=rng.randint(*spec.output_len))
                # A stopped engine refuses here: the run ends, saying why.
                stream = self.engine.submit(self.prompt(spec, rng), params, source="loadgen")
                with self._lock:
                    run.sent += 1
                pool.submit(self._drain, run, stream)

    def _wait_until(self, moment: float) -> None:
        while (delay := moment - time.monotonic()) > 0 and self.engine.is_running:
            time.sleep(min(delay, ENGINE_CHECK_S))

    def _drain(self, run: LoadRun, stream) -> None:
        try:
            for last in stream:
                pass
            # The rule /metrics counts by (vllm:request_success's finished_reason): an
            # output that ends without a reason of its own was aborted.
            outcome = "aborted" if (last.outputs[0].finish_reason or "abort") == "abort" \
                else "finished"
        except (ValueError, RuntimeError):  # refused, or a failed step: counted in status
            outcome = "failed"
        with self._lock:
            setattr(run, outcome, getattr(run, outcome) + 1)
            if run.finished + run.aborted + run.failed == run.spec.num_requests:
                run.ended = time.monotonic()
