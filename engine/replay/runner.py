"""The replay loop, shared by both modes, and a run of a workload per config.

Before each step the loop admits every request whose arrival time has come on the replay's
clock; when the engine is idle the clock skips (simulated) or sleeps (live) to the next
arrival. A live clock advances by each loop turn's measured seconds, a simulated one by the
step-cost model's, so a simulation given a live run's own step times (RecordedStepTimes)
admits every request between the same two steps and allocates the same blocks.
"""

import dataclasses
import json
import logging
import time
from collections import deque
from collections.abc import Callable

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator import heap
from kvscope.engine.orchestrator.engine_core import EngineCore, StepResult
from kvscope.engine.replay.cost_model import CostModelSource
from kvscope.engine.replay.metrics import RequestTiming, RunResult, StepSample
from kvscope.engine.replay.simulated_runner import SimulatedRunner
from kvscope.engine.replay.simulated_tier import TierWhatIf, simulated_tier
from kvscope.engine.replay.workload import Workload
from kvscope.engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
MODES = ("live", "simulated")
# Knobs fixed when the weights load: engines that share them share one ModelRunner.
WEIGHT_KNOBS = ("model", "dtype", "device", "quantization", "quantization_group_size",
                "enforce_eager")


class LiveClock:
    """Real seconds since the run began; an idle wait's oversleep is not counted, so the
    clock is the sum of the steps' measured times and the arrival gaps."""

    def __init__(self) -> None:
        self.now = 0.0
        self._mark = time.perf_counter()

    def step(self, core: EngineCore) -> tuple[StepResult, float]:
        """One step, and the seconds since the previous one ended (the loop's own work
        between steps, admitting requests, counts toward the step it precedes)."""
        result = core.step()
        mark = time.perf_counter()
        duration, self._mark = mark - self._mark, mark
        self.now += duration
        return result, duration

    def idle_until(self, moment: float) -> None:
        ahead = moment - (self.now + time.perf_counter() - self._mark)
        if ahead > 0:
            time.sleep(ahead)
        self.now, self._mark = moment, time.perf_counter()


class SimulatedClock:
    """Modelled seconds: each step advances by what the cost model says it takes."""

    def __init__(self, cost_model) -> None:
        self.cost_model = cost_model
        self.now = 0.0

    def step(self, core: EngineCore) -> tuple[StepResult, float]:
        result = core.step()
        duration = self.cost_model.step_time(result.record)
        self.now += duration
        return result, duration

    def idle_until(self, moment: float) -> None:
        self.now = moment


def replay_workload(core: EngineCore, workload: Workload, clock, *, speed: float = 1.0,
                    simulated: bool = False, label: str = "", config: dict | None = None,
                    progress: Callable[[int, int], None] | None = None) -> RunResult:
    """Run every request of the workload through `core` at its (speed-scaled) arrival time."""
    if not (isinstance(speed, (int, float)) and speed > 0):
        raise ValueError(f"speed={speed!r} must be > 0")
    if simulated:  # refused before anything runs: a run is never left half done
        for request in workload.requests:
            if request.beam_search:
                request.params(simulated)  # raises, naming the request and why
    started = time.perf_counter()
    pending = deque(workload.requests)
    timings: dict[str, RequestTiming] = {}
    steps: list[StepSample] = []
    records = []
    num_blocks = core.kv_cache.pool.num_blocks
    num_finished = 0
    # Under fcfs every request runs at the default priority: the what-if is the same trace
    # served in arrival order.
    by_priority = core.config.scheduling_policy == "priority"
    while pending or core.has_unfinished_requests():
        if not core.has_unfinished_requests() and pending[0].arrival_s / speed > clock.now:
            clock.idle_until(pending[0].arrival_s / speed)
        while pending and pending[0].arrival_s / speed <= clock.now:
            request = pending.popleft()
            try:
                core.add_request(request.prompt_token_ids, request.params(simulated),
                                 request_id=request.request_id, source="replay",
                                 priority=request.priority if by_priority else 0)
            except ValueError as error:
                raise ValueError(f"request {request.request_id}: {error}") from None
            timings[request.request_id] = RequestTiming(
                request.request_id, request.arrival_s / speed, len(request.prompt_token_ids))
        result, duration = clock.step(core)
        for output in result.outputs:
            timing = timings[output.request_id]
            timing.num_output_tokens = sum(len(c.token_ids) for c in output.outputs)
            if timing.num_output_tokens and timing.first_token_s is None:
                timing.first_token_s = clock.now
            if output.finished:
                timing.finished_s = clock.now
                timing.output_token_ids = list(output.outputs[0].token_ids)
                num_finished += 1
        record = result.record
        records.append(record)
        steps.append(StepSample(clock.now, duration, record.num_used_blocks / num_blocks,
                                len(record.preempted), record.num_blocks_swapped_out,
                                record.prefix_cache_queries, record.prefix_cache_hits,
                                record.num_used_blocks))
        if progress is not None:
            progress(num_finished, len(workload.requests))
    return RunResult(label, config or {}, "simulated" if simulated else "live", num_blocks,
                     list(timings.values()), steps, records, time.perf_counter() - started)


# ---- configs -----------------------------------------------------------------------------
def parse_knob(text: str) -> tuple[str, object]:
    """KEY=VALUE with VALUE as JSON where it parses (32, 0.5, true, null), else text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--config {text!r}: expected KEY=VALUE")
    lowered = value.strip()
    if lowered.lower() in ("none", "null"):
        return key.strip(), None
    if lowered.lower() in ("true", "false"):
        return key.strip(), lowered.lower() == "true"
    try:
        return key.strip(), json.loads(lowered)
    except json.JSONDecodeError:
        return key.strip(), lowered


def base_config(workload: Workload, **knobs) -> EngineConfig:
    """The recorded session's config (knobs this version does not know are dropped, with
    a warning), else the defaults; `knobs` (e.g. model) on top, where given."""
    recorded = dict(workload.config or {})
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    dropped = sorted(set(recorded) - known)
    if dropped:
        logger.warning("the recorded config's knobs %s are unknown here; replaying without "
                       "them", dropped)
    values = {k: v for k, v in recorded.items() if k in known}
    values.update({k: v for k, v in knobs.items() if v is not None})
    return EngineConfig(**values)


def run_label(changes: dict) -> str:
    """The knobs a run changed; "base config": the recorded session's, or the defaults."""
    return ", ".join(f"{k}={v}" for k, v in changes.items()) or "base config"


class ReplaySession:
    """Runs one workload under several configs; loaded weights are kept between runs that
    share them (the weight knobs), so each config costs its run, not a model load."""

    def __init__(self, workload: Workload, base: EngineConfig, cost_model=None,
                 cost_model_source: CostModelSource | None = None) -> None:
        self.workload = workload
        self.base = base
        self.cost_model = cost_model  # for simulated runs: StepCost, RecordedStepTimes
        self.cost_model_source = cost_model_source  # where it came from, for the report
        self._runners: dict[tuple, ModelRunner] = {}
        self._simulators: dict[tuple, SimulatedRunner] = {}

    def run(self, changes: dict, mode: str = "live", speed: float = 1.0,
            progress: Callable[[int, int], None] | None = None,
            tier: TierWhatIf | None = None) -> RunResult:
        """One run of the workload with `changes` to the base config; `tier`: a simulated
        disk tier under the pool (simulated runs only)."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} must be one of {list(MODES)}")
        if tier is not None and mode != "simulated":
            raise ValueError("kv_offload_gb: the what-if tier is simulated; a live replay "
                             "runs the real one (--config kv_offload_dir=PATH kv_offload_gb=N)")
        config = self.base.with_changes(**changes)
        if mode == "live":
            core = EngineCore(config, runner=self.model_runner(config))
            clock = LiveClock()
        else:
            if self.cost_model is None:
                raise ValueError("cost_model: a simulated replay needs a step-cost model (a "
                                 "session log to fit one to, or a saved one)")
            if config.speculative_config is not None:
                # Acceptance depends on the tokens, which a simulation does not compute.
                raise ValueError("speculative_config: a simulated replay cannot model "
                                 "speculation (acceptance depends on real tokens); replay it "
                                 "live")
            core = EngineCore(config, runner=self._simulator(config))
            clock = SimulatedClock(self.cost_model)
            if tier is not None:
                core.attach_kv_tier(simulated_tier(core, clock, tier))
        # As a served engine does (engine.orchestrator.heap): the pool's blocks, the workload
        # and the loaded modules live through the run, so collections skip them. Unfrozen,
        # each generation-2 collection walked a 1M-block pool and 10,000 prompts' token
        # lists: half the CPU time of bench/replay.py's simulated run.
        heap.freeze_long_lived()
        try:
            label = run_label(changes) + (f" + {tier.label}" if tier is not None else "")
            knobs = changes if tier is None else {**changes, "kv_offload_gb": tier.size_gb}
            result = replay_workload(core, self.workload, clock, speed=speed,
                                     simulated=mode == "simulated", label=label,
                                     config=knobs, progress=progress)
        finally:
            core = None
            heap.rebase()  # reclaim this run's pool: its free queue links it into cycles
        if mode == "simulated":
            result.cost_model = self.cost_model_source
        return result

    def model_runner(self, config: EngineConfig) -> ModelRunner:
        """The loaded weights for `config`'s weight knobs (loaded on first use)."""
        key = tuple(getattr(config, knob) for knob in WEIGHT_KNOBS)
        if key not in self._runners:
            self._runners[key] = ModelRunner(config)
        return self._runners[key]

    def _simulator(self, config: EngineConfig) -> SimulatedRunner:
        sizing = None if config.num_gpu_blocks_override else self.model_runner(config)
        key = (*(getattr(config, knob) for knob in WEIGHT_KNOBS), sizing is None)
        if key not in self._simulators:
            self._simulators[key] = SimulatedRunner(config, sizing)
        return self._simulators[key]
