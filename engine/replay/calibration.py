"""Self-calibration: a step-cost model for this model on this machine, from a short live
profile, for a simulated replay given no step records to fit one to.

The real engine (the run's weights, dtype, device and KV-cache dtype) runs a fixed plan of
synthetic requests, one phase at a time, so every step's shape is known in advance:

  prefills  one prompt alone, PREFILL_REPEATS times for each length in PREFILL_TOKENS
            under the model's limit: steps of one prefill chunk of each size
  decodes   batches of DECODE_BATCHES prompts decoding together, first on short prompts,
            then on prompts behind one LONG_CONTEXT-token prefix (prefilled once, by a
            request of its own; the batches find it in the prefix cache): decode steps of
            each row count with little context and with much, and each batch's prefill of
            its own tokens behind that context

The cost model (cost_model.py) is fitted to those steps' times, measured as a live replay
measures its own (runner.LiveClock), each replaced by the median of the steps of its shape
in its phase (or the repeats of its phase): on a shared machine a step now and then takes
several times its usual (another process ran), and least squares let those few pull every
coefficient. The fit weighs relative errors (the plan's longest prefills take a hundred
times its decode steps) and is cached (calibration_cache.py). The plan depends on the model's
position limit only, so one calibration serves every config of a replay that keeps the
weight knobs and the KV-cache dtype; block size, budget and pool are the calibration's own
(the cost model's features are the rows, decodes and context a step ran, whatever config
scheduled them).
"""

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.replay.calibration_cache import (
    calibration_key,
    load_calibration,
    store_calibration,
)
from kvscope.engine.replay.cost_model import (
    CostModelSource,
    StepCost,
    fit_step_cost,
    step_features,
)
from kvscope.engine.replay.runner import LiveClock
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.loader import load_config, resolve_model_path
from kvscope.engine.worker.model_runner import ModelRunner
from kvscope.engine.worker.models import language_model_config

logger = logging.getLogger(__name__)
# Up to 512 tokens (past it the fit's last slope carries on): a 2048-token prefill of the
# default model takes seconds on two cores, and the calibration is meant to take about 30.
PREFILL_TOKENS = (16, 32, 64, 128, 256, 512)
PREFILL_REPEATS = 3
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
LONG_CONTEXT = 1024  # tokens every prompt of a long-context decode phase shares
OWN_TOKENS = 16  # each decode-phase prompt's tokens after the shared prefix
DECODE_TOKENS = 12  # each decode-phase request's output: 11 decode steps
BLOCK_SIZE = 16
# The knobs a step's time depends on beyond the rows it runs: copied from the run.
COPIED_KNOBS = ("model", "dtype", "device", "quantization", "quantization_group_size",
                "enforce_eager", "prepack_weights", "kv_cache_dtype")


@dataclass(frozen=True, slots=True)
class Phase:
    """Requests that arrive together and run until all finish: `batch` prompts of `own`
    tokens each after a `shared`-token prefix (the same for every phase that has one)."""

    batch: int
    shared: int
    own: int
    outputs: int


def calibration_plan(max_positions: int) -> list[Phase]:
    """The phases, within the model's position limit; the long-context ones last, one after
    another, so their prefix stays cached from the first to the last."""
    prefills = [Phase(1, 0, tokens, 1) for tokens in PREFILL_TOKENS if tokens < max_positions
                for _ in range(PREFILL_REPEATS)]
    # A block-aligned prefix, so the batches find all of it cached.
    long_context = min(LONG_CONTEXT, max_positions // 2) // BLOCK_SIZE * BLOCK_SIZE
    decodes = [Phase(batch, shared, OWN_TOKENS, DECODE_TOKENS) for shared in (0, long_context)
               for batch in DECODE_BATCHES]
    return prefills + decodes


def calibration_config(config: EngineConfig, plan: list[Phase]) -> EngineConfig:
    """The run's copied knobs, and a budget, seats and pool that fit any phase beside the
    shared prefix (the pool keeps it cached while the long-context phases run)."""
    longest = max(p.shared + p.own + p.outputs for p in plan)
    blocks = (_blocks(max(p.shared for p in plan) + 1)
              + max(p.batch * (_blocks(p.own + p.outputs) + 1) for p in plan))
    return EngineConfig(**{name: getattr(config, name) for name in COPIED_KNOBS},
                        block_size=BLOCK_SIZE, max_model_len=longest,
                        max_num_batched_tokens=max(longest, max(p.batch * p.own for p in plan)),
                        max_num_seqs=max(DECODE_BATCHES), num_gpu_blocks_override=blocks)


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def profile_steps(core: EngineCore, plan: list[Phase], seed: int = 0) -> tuple[list, list]:
    """Run the plan's phases one after another on `core`: each step's record and its
    seconds, the median of its shape's in its phase. Prompts are random tokens, so a phase
    finds nothing of another's in the prefix cache but the shared prefix."""
    rng = random.Random(seed)
    vocab = core.runner.hf_config.vocab_size
    prefixes: dict[int, list[int]] = {}
    records, durations, shapes = [], [], []
    clock = LiveClock()
    for phase in plan:
        stages = []
        if phase.shared not in prefixes:
            prefixes[phase.shared] = [rng.randrange(vocab) for _ in range(phase.shared)]
            if phase.shared:
                stages.append(([prefixes[phase.shared]], 1))
        stages.append(([prefixes[phase.shared] + [rng.randrange(vocab) for _ in range(phase.own)]
                        for _ in range(phase.batch)], phase.outputs))
        for prompts, outputs in stages:
            params = SamplingParams(temperature=0, max_tokens=outputs, ignore_eos=True,
                                    detokenize=False)
            for prompt in prompts:
                core.add_request(prompt, params)
            while core.has_unfinished_requests():
                result, seconds = clock.step(core)
                records.append(result.record)
                durations.append(seconds)
                tokens, decodes, _ = step_features(result.record)
                shapes.append((phase, len(prompts), tokens, decodes))
    return records, group_medians(shapes, durations)


def group_medians(keys: list, values: list[float]) -> list[float]:
    """Each value replaced by the median of the values sharing its key."""
    groups: dict = {}
    for key, value in zip(keys, values):
        groups.setdefault(key, []).append(value)
    medians = {key: float(np.median(group)) for key, group in groups.items()}
    return [medians[key] for key in keys]


def self_calibrated_cost(config: EngineConfig, model_runner: Callable[[EngineConfig], ModelRunner],
                         recalibrate: bool = False) -> tuple[StepCost, CostModelSource]:
    """The cached calibration for `config`'s model, knobs and this machine, or a fresh one
    (`recalibrate`: always fresh). `model_runner(config)` gives the loaded weights; it is
    called only when a calibration runs."""
    max_positions = language_model_config(
        load_config(resolve_model_path(config.model))).max_position_embeddings
    plan = calibration_plan(max_positions)
    calibrating = calibration_config(config, plan)
    key = calibration_key(calibrating, {name: getattr(calibrating, name) for name in COPIED_KNOBS},
                          [dataclasses.astuple(phase) for phase in plan])
    if not recalibrate and (cached := load_calibration(key)) is not None:
        return cached
    started = time.perf_counter()
    core = EngineCore(calibrating, runner=model_runner(calibrating))
    # The first steps of a fresh engine pay for one-time set-up (the kernels' first calls);
    # a short phase, unrecorded, takes that out of the fit.
    profile_steps(core, [Phase(2, 0, OWN_TOKENS, 3)], seed=1)
    records, durations = profile_steps(core, plan)
    cost = fit_step_cost(records, durations, relative=True)
    source = store_calibration(key, cost, time.perf_counter() - started)
    logger.info("step-cost model: %s", source.describe())
    return cost, source
