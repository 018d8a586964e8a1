"""Weight-only quantization against dense weights, every mode in one run on one machine.

For each mode (a quantization and an activation dtype) it loads the model once and prints,
as JSON:

  single_stream_tok_s   one greedy request of --single-tokens output tokens after a short chat
                        prompt: its decode rate (first token to last, bench/throughput.py's
                        single-stream metric), the median of --repeats rounds. Every mode
                        stays loaded and each round runs every mode once, back to back: this
                        host's memory speed drifts by up to half from one minute to the
                        next (docs/performance.md, 'int4 and int8 weights'), so modes
                        measured minutes apart compare drift, and vs_bf16 is the median of
                        each round's own ratios.
  single_stream         every round's decode rate, first-token latency and end-to-end rate
                        (output tokens over the whole call: chat template, prefill, decode)
  batched_tok_s         bench/throughput.py's kvscope workload (its defaults unless the
                        --num-requests / --max-prompt / --max-output flags shrink it)
  perplexity            of the model on a fixed English text that ships with Python
                        (its LICENSE.txt), first --ppl-tokens tokens, teacher-forced in
                        one prefill (many rows: the packed layers' de-quantize + GEMM path)
  perplexity_streamed   the same, fed KERNEL_MAX_ROWS tokens per forward: the streaming
                        kernels a decode runs, whose bf16 activations are rounded to int8
                        per 32 values on VNNI CPUs (so that rounding's cost shows here)
  agreement             greedy continuations of 16 prompts, KERNEL_MAX_ROWS at a time (so
                        decode steps stream, as a single stream does), against the first
                        mode's (fp32): mean position of the first differing token (= the
                        length when none differs) and how many are identical
  weight_mb, pool_blocks the packed weights the memory plan subtracted, and the KV pool

Usage:
  flock /work/bench.lock python bench/quantization.py
  python bench/quantization.py --modes int4=int4/bfloat16,bf16=none/bfloat16 --skip-batched
"""

import argparse
import hashlib
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch
from throughput import KVScope, make_workload, stream_result  # noqa: E402
from throughput import parse_args as throughput_args  # noqa: E402

from kvscope import LLM, SamplingParams  # noqa: E402
from kvscope.engine.worker.models.quantized import KERNEL_MAX_ROWS  # noqa: E402

logger = logging.getLogger("bench.quantization")
DEFAULT_MODES = "fp32=none/float32,bf16=none/bfloat16,int8=int8/bfloat16,int4=int4/bfloat16"
TEXT = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "Once upon a time, there was",
    "The three primary colors are", "To make a cup of tea, you first", "The largest planet in",
    "Photosynthesis is the process by which", "In 1969, the first humans", "A good night's sleep",
    "The main ingredients of bread are", "Python is a programming language that",
    "The tallest mountain in the world", "Exercise is important because", "The sun rises in the",
    "Shakespeare wrote plays such as", "The best way to learn a new language is",
]
CHAT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


def parse_modes(text: str) -> dict[str, tuple[str, str]]:
    modes = {}
    for item in text.split(","):
        name, _, spec = item.partition("=")
        quantization, _, dtype = spec.partition("/")
        modes[name.strip()] = (quantization.strip(), dtype.strip())
    return modes


def single_stream(llm: LLM, tokens: int) -> dict:
    """One greedy chat reply: its decode rate and first-token latency (bench/throughput.py's
    stream_result), and its output tokens over the whole call."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.engine.kv_cache.pool.reset_cache()  # no run may reuse the last one's prefix
    started = time.perf_counter()
    output = llm.chat(CHAT, params, use_tqdm=False)[0]
    seconds = time.perf_counter() - started
    metrics = output.metrics
    return {**stream_result(metrics.time_to_first_token,
                            metrics.finished_time - metrics.first_token_time, tokens),
            "end_to_end_tok_s": round(len(output.outputs[0].token_ids) / seconds, 2)}


def single_streams_in_rounds(llms: dict[str, LLM], tokens: int, rounds: int) -> dict:
    """Each mode's single stream `rounds` times, every round running each mode once."""
    runs = {name: [] for name in llms}
    for _ in range(rounds):
        for name, llm in llms.items():
            runs[name].append(single_stream(llm, tokens))
    return runs


@torch.inference_mode()
def perplexity(llm: LLM, token_ids: list[int], tokens_per_forward: int) -> float:
    """exp(mean negative log-likelihood) of each token given the ones before it, in
    forwards of `tokens_per_forward` tokens over the engine's own KV cache (no request
    holds a block at this point)."""
    runner = llm.engine.runner
    block_size = runner.block_size
    table = list(range(-(-len(token_ids) // block_size)))
    logits = []
    for start in range(0, len(token_ids), tokens_per_forward):
        end = min(start + tokens_per_forward, len(token_ids))
        input_ids, positions, meta = runner._flat_inputs(
            [(start, end, table)], block_size, token_ids=lambda _, a, b: token_ids[a:b])
        logits.append(runner.model.compute_logits(runner.model(input_ids, positions, meta)))
    targets = torch.tensor(token_ids[1:])
    nll = torch.nn.functional.cross_entropy(torch.cat(logits)[:-1].float(), targets)
    llm.engine.kv_cache.pool.reset_cache()
    return float(torch.exp(nll))


def greedy_continuations(llm: LLM, tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [o.outputs[0].token_ids
            for start in range(0, len(PROMPTS), KERNEL_MAX_ROWS)
            for o in llm.generate(PROMPTS[start:start + KERNEL_MAX_ROWS], params,
                                  use_tqdm=False)]


def first_divergence(reference: list[int], other: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), len(reference))


def batched(llm: LLM, args: argparse.Namespace) -> dict:
    """bench/throughput.py's kvscope backend, on this already loaded engine."""
    flags = ["--backends", "kvscope", "--num-requests", str(args.num_requests),
             "--max-prompt", str(args.max_prompt), "--max-output", str(args.max_output)]
    workload_args = throughput_args(flags)
    workload = make_workload(workload_args, llm.get_tokenizer(),
                             llm.engine.runner.hf_config.vocab_size)
    backend = KVScope(workload_args, workload, llm.engine.runner.model_path, llm=llm)
    return {**backend.run(), "workload": workload.describe(workload_args)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--modes", default=DEFAULT_MODES,
                        help="name=quantization/dtype,...; the first is the agreement reference")
    parser.add_argument("--single-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5,
                        help="rounds of single streams (every mode once per round)")
    parser.add_argument("--ppl-tokens", type=int, default=1024)
    parser.add_argument("--agreement-tokens", type=int, default=64)
    parser.add_argument("--skip-batched", action="store_true")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1 round of single streams")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    text = TEXT.read_text()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()
    report = {"commit": commit, "torch": torch.__version__,
              "torch_threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(),
              "perplexity_text": {"path": str(TEXT),
                                  "sha256": hashlib.sha256(text.encode()).hexdigest()[:16]},
              "modes": {}}
    reference, llms = None, {}
    for name, (quantization, dtype) in parse_modes(args.modes).items():
        logger.info("mode %s: quantization=%s dtype=%s", name, quantization, dtype)
        started = time.perf_counter()
        llm = LLM(args.model, quantization=quantization, dtype=dtype)
        row = {"quantization": quantization, "dtype": dtype,
               "load_seconds": round(time.perf_counter() - started, 1),
               "weight_mb": round(llm.engine.runner.weight_bytes / 1e6, 1),
               "pool_blocks": llm.engine.memory_plan.num_blocks}
        tokens = llm.get_tokenizer()(text, add_special_tokens=False)["input_ids"][:args.ppl_tokens]
        report["perplexity_text"]["tokens"] = len(tokens)
        row["perplexity"] = round(perplexity(llm, tokens, len(tokens)), 3)
        row["perplexity_streamed"] = round(perplexity(llm, tokens, KERNEL_MAX_ROWS), 3)
        continuations = greedy_continuations(llm, args.agreement_tokens)
        reference = reference or continuations
        positions = [first_divergence(r, c) for r, c in zip(reference, continuations)]
        row["agreement"] = {"mean_first_divergence": sum(positions) / len(positions),
                            "identical": sum(p == args.agreement_tokens for p in positions),
                            "of": len(positions), "tokens": args.agreement_tokens}
        if not args.skip_batched:
            row["batched"] = batched(llm, args)
            row["batched_tok_s"] = row["batched"]["output_tokens_per_s"]
        logger.info("%s: %s", name, {k: v for k, v in row.items() if k != "batched"})
        report["modes"][name] = row
        llms[name] = llm  # kept for the single streams, run in rounds across the modes
    runs = single_streams_in_rounds(llms, args.single_tokens, args.repeats)
    decode = {name: [run["decode_tokens_per_s"] for run in runs[name]] for name in runs}
    for name, row in report["modes"].items():
        row["single_stream"] = runs[name]
        row["single_stream_tok_s"] = round(statistics.median(decode[name]), 2)
    if "bf16" in report["modes"]:
        base = report["modes"]["bf16"]
        report["vs_bf16"] = {
            name: {"single_stream_tok_s": round(statistics.median(
                       [mine / theirs for mine, theirs in zip(decode[name], decode["bf16"])]), 3),
                   **({"batched_tok_s": round(row["batched_tok_s"] / base["batched_tok_s"], 3)}
                      if "batched_tok_s" in row else {})}
            for name, row in report["modes"].items()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
