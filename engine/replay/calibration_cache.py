"""Self-calibrated step-cost models on disk, beside the memory profiles, keyed by what a
step's time depends on.

The key is the memory profile's (engine/worker/profile_cache.py: the model files, the
dtype, the device and its name, the CPU's torch threads, the kernels' backend, the code a
forward runs, the libraries under it) plus the C++ kernels' build (its compiler, flags and
target CPU), the knobs the calibration copies from the run and the plan it ran: a changed
machine, model or build calibrates afresh.
"""

import logging
from datetime import datetime, timezone
from pathlib import Path

from kvscope import kernels
from kvscope.engine.config import EngineConfig
from kvscope.engine.replay.cost_model import CostModelSource, StepCost
from kvscope.engine.worker.loader import resolve_model_path
from kvscope.engine.worker.model_runner import resolve_device, resolve_dtype
from kvscope.engine.worker.profile_cache import (
    entry_path,
    profile_cache_dir,
    profile_key,
    read_entry,
    write_entry,
)
from kvscope.kernels import cpu_extension

logger = logging.getLogger(__name__)


def step_cost_cache_dir() -> Path:
    return profile_cache_dir() / "step_costs"


def calibration_key(config: EngineConfig, knobs: dict, plan: list) -> dict:
    """What a calibration under `config` measures depends on; `knobs` are the run's knobs
    it copied, `plan` its phases (JSON-able)."""
    device = resolve_device(config.device)
    ops = kernels.select_ops(device)  # as the ModelRunner that calibrates chooses them
    dtype = resolve_dtype(config.dtype, device, config.quantization, ops)
    build = cpu_extension.build_key() if ops.backend == "cpu" else None
    return profile_key(resolve_model_path(config.model), dtype, device, ops.backend,
                       {"kernel_build": build, "knobs": knobs, "plan": plan})


def load_calibration(key: dict) -> tuple[StepCost, CostModelSource] | None:
    """The model cached for exactly this key, or None."""
    entry = read_entry(step_cost_cache_dir(), key)
    if entry is None:
        return None
    try:
        cost = StepCost.from_json(entry["cost_model"])
        source = CostModelSource("self-calibration", str(entry_path(step_cost_cache_dir(), key)),
                                 cost.num_fit_steps, cost.fit_error, entry["made_at"],
                                 entry["calibration_s"], reused=True)
    except (KeyError, TypeError, ValueError):  # an older or damaged entry: calibrate again
        return None
    logger.info("step-cost model: reused %s", source.describe())
    return cost, source


def store_calibration(key: dict, cost: StepCost, calibration_s: float) -> CostModelSource:
    """Cache a fresh calibration; its source names the file (or where it would have been,
    when it could not be written: the warning says so)."""
    made_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    calibration_s = round(calibration_s, 3)  # as the cache keeps it: reused, it reads the same
    fields = {"cost_model": cost.to_json(), "made_at": made_at, "calibration_s": calibration_s}
    path = write_entry(step_cost_cache_dir(), key, fields)
    return CostModelSource("self-calibration",
                           str(path or entry_path(step_cost_cache_dir(), key)),
                           cost.num_fit_steps, cost.fit_error, made_at, calibration_s)

