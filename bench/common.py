"""Shared pieces of the engine benchmarks: one loaded model, engines on it, a step driver."""

import argparse
import logging
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch

from kvscope.engine.config import EngineConfig  # noqa: E402
from kvscope.engine.orchestrator.engine_core import EngineCore  # noqa: E402
from kvscope.engine.outputs import RequestOutput  # noqa: E402
from kvscope.engine.sampling_params import SamplingParams  # noqa: E402
from kvscope.engine.telemetry.records import StepRecord  # noqa: E402
from kvscope.engine.worker.model_runner import ModelRunner  # noqa: E402

logger = logging.getLogger("bench")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16",
                                                            "float16"))
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--device-memory-gb", type=float, default=None,
                        help="the CPU's pool budget (engine default: 2 GiB)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice); on a CPU that "
                             "other work shares, 1 is often several times faster")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantization", default=None, choices=("none", "int8", "int4", "gguf"),
                        help="the engine's weight format (default: the engine's, dense for a "
                             "folder; gguf keeps a GGUF file's blocks)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="the layers one by one from Python, not the one-call decoder stack")
    parser.add_argument("--prepack-weights", action=argparse.BooleanOptionalAction, default=None,
                        help="EngineConfig.prepack_weights: bf16 weights kept in tiles (default: "
                             "the CPU's)")


def setup(args: argparse.Namespace, max_model_len: int) -> "Bench":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    knobs = {"model": args.model, "dtype": args.dtype, "device": args.device,
             "max_model_len": max_model_len, "enforce_eager": args.enforce_eager,
             "prepack_weights": args.prepack_weights}
    if args.device_memory_gb is not None:
        knobs["device_memory_gb"] = args.device_memory_gb
    if args.quantization is not None:
        knobs["quantization"] = args.quantization
    runner = ModelRunner(EngineConfig(**knobs))
    bench = Bench(runner, knobs, time.perf_counter() - started)
    logger.info("model loaded in %.1f s", bench.load_seconds)
    # One small untimed request, so the first measured run pays no one-time costs.
    vocab = ordinary_token_ids(runner)
    drive(bench.engine(), [(0, vocab[:64], SamplingParams(max_tokens=4, ignore_eos=True))])
    return bench


@dataclass
class Run:
    """What one workload did on one engine."""

    records: list[StepRecord]
    outputs: dict[str, RequestOutput]
    arrival_step: dict[str, int]
    seconds: float
    engine: EngineCore

    def first_token_step(self) -> dict[str, int]:
        """The step whose forward produced each request's first token (its prompt's end)."""
        prompt_len = {rid: len(o.prompt_token_ids) for rid, o in self.outputs.items()}
        found: dict[str, int] = {}
        for record in self.records:
            for request_id, _, kind, _, end in record.chunks:
                if (request_id not in found and kind == "prefill"
                        and end >= prompt_len.get(request_id, 1 << 62)):
                    found[request_id] = record.step
        return found

    @property
    def prefill_tokens(self) -> int:
        return sum(end - start for r in self.records for _, _, kind, start, end in r.chunks
                   if kind == "prefill")

    @property
    def output_tokens(self) -> int:
        return sum(len(c.token_ids) for o in self.outputs.values() for c in o.outputs)

    def ttft(self, request_ids=None) -> list[float]:
        ids = self.outputs if request_ids is None else request_ids
        return [self.outputs[i].metrics.time_to_first_token for i in ids
                if self.outputs[i].metrics.time_to_first_token is not None]


@dataclass
class Bench:
    runner: ModelRunner
    base_knobs: dict
    load_seconds: float
    engines_made: int = field(default=0)

    def engine(self, **knobs) -> EngineCore:
        """A fresh engine (its own block pool) on the loaded weights. The runner holds one
        KV cache, the latest engine's: an engine made before it refuses to step again."""
        self.engines_made += 1
        return EngineCore(EngineConfig(**self.base_knobs, **knobs), runner=self.runner)

    def engine_with_own_weights(self, **knobs) -> EngineCore:
        """An engine on a runner of its own (the weights loaded again), for engines that
        step side by side: each keeps its own KV cache."""
        self.engines_made += 1
        config = EngineConfig(**self.base_knobs, **knobs)
        return EngineCore(config, runner=ModelRunner(config))

    def describe(self) -> dict:
        return {"model": str(self.runner.model_path), "dtype": str(self.runner.dtype),
                "device": str(self.runner.device), "torch": torch.__version__,
                "torch_threads": torch.get_num_threads(),
                "machine": platform.processor() or platform.machine(),
                "model_load_seconds": round(self.load_seconds, 1)}


def drive(engine: EngineCore, arrivals: list[tuple[int, object, object]],
          on_step: Callable[[EngineCore], None] | None = None) -> Run:
    """Add each (arrival step, prompt, params) between steps once the engine has run that
    many steps (an idle engine skips ahead to the next arrival); step until all finish."""
    pending = sorted(arrivals, key=lambda a: a[0])
    records, outputs, arrival_step = [], {}, {}
    steps_run = 0
    started = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            steps_run = max(steps_run, pending[0][0])
        while pending and pending[0][0] <= steps_run:
            _, prompt, params = pending.pop(0)
            request = engine.add_request(prompt, params)
            arrival_step[request.request_id] = engine.step_index
        result = engine.step()
        steps_run += 1
        records.append(result.record)
        for output in result.outputs:
            if output.finished:
                outputs[output.request_id] = output
        if on_step is not None:
            on_step(engine)
    return Run(records, outputs, arrival_step, time.perf_counter() - started, engine)


def ordinary_token_ids(runner: ModelRunner) -> list[int]:
    special = set(runner.tokenizer.all_special_ids)
    size = min(runner.hf_config.vocab_size, len(runner.tokenizer))
    return [i for i in range(size) if i not in special]


def random_prompt(rng: random.Random, vocab: list[int], length: int) -> list[int]:
    return [rng.choice(vocab) for _ in range(length)]


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    index = (len(ordered) - 1) * q / 100
    low = int(index)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (index - low)


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)
