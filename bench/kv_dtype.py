"""kv_cache_dtype: a quantized KV cache against the model-dtype one, every dtype in one run.

On one loaded model (default SmolLM2-135M-Instruct, bf16 weights) it prints, as JSON, per
kv_cache_dtype:

  bytes_per_block, pool_blocks   the memory plan at --device-memory-gb (the default 2 GiB),
                                 and blocks_vs_auto, their ratio to auto's
  perplexity                     bench/quantization.py's: the fixed English text (Python's
                                 LICENSE.txt), first --ppl-tokens tokens, in one prefill that
                                 stores and then reads the quantized cache; vs_auto its ratio
  mean_first_divergence          greedy continuations of bench/quantization.py's 16 prompts
                                 (--agreement-tokens each) against auto's: the mean position
                                 of the first differing token (= the length when none does)
  decode_tok_s                   --decode-seqs sequences of --context-tokens random prompt
                                 tokens each, then --decode-tokens greedy tokens: the output
                                 tokens of the steps where every sequence decodes, over those
                                 steps' time (a pool of --decode-memory-gb, the same for every
                                 dtype, holds them all; the dtypes' engines take their steps
                                 in turn, so the host's drift falls on all); vs_auto its ratio

and, once, `scale_granularity`: the perplexity with K/V rounded to each code format at three
granularities, on the layer-by-layer path over a model-dtype cache (the rounding is what the
cache would hold): per tensor with scale 1 (vLLM's fp8 default without calibration), per
tensor with the text's own largest value (the best a calibrated static scale can do), and
per token and KV head (what kv_cache_dtype stores).

Usage:
  flock /work/bench.lock python bench/kv_dtype.py
  python bench/kv_dtype.py --dtypes auto,int8 --decode-seqs 8 --context-tokens 512
"""

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch  # noqa: E402
from common import add_model_args, ordinary_token_ids, setup  # noqa: E402
from quantization import PROMPTS, TEXT, first_divergence, perplexity  # noqa: E402

from kvscope.engine.config import EngineConfig  # noqa: E402
from kvscope.engine.core.request import ChunkKind  # noqa: E402
from kvscope.engine.orchestrator.engine_core import EngineCore  # noqa: E402
from kvscope.engine.sampling_params import SamplingParams  # noqa: E402
from kvscope.engine.worker.model_runner import ModelRunner  # noqa: E402
from kvscope.engine.worker.models.bound_ops import bind_kernel_ops  # noqa: E402
from kvscope.kernels import kv_quant  # noqa: E402


def continuations(engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step().outputs if o.finished)
    return [list(done[i].outputs[0].token_ids) for i in ids]


def decode_rates(engines: dict[str, EngineCore], prompts: list[list[int]],
                 tokens: int) -> dict[str, dict]:
    """Per engine, output tokens per second over the steps where every scheduled chunk is a
    decode. The engines take their steps in turn, one each, so a change in the machine's
    speed during the run (a shared host's) falls on every dtype alike."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for engine in engines.values():
        for prompt in prompts:
            engine.add_request(prompt, params)
    seconds = dict.fromkeys(engines, 0.0)
    decoded = dict.fromkeys(engines, 0)
    while any(engine.has_unfinished_requests() for engine in engines.values()):
        for name, engine in engines.items():
            if not engine.has_unfinished_requests():
                continue
            started = time.perf_counter()
            record = engine.step().record
            elapsed = time.perf_counter() - started
            if record.chunks and all(chunk[2] == ChunkKind.DECODE for chunk in record.chunks):
                seconds[name] += elapsed
                decoded[name] += len(record.chunks)
    return {name: {"decode_tok_s": round(decoded[name] / seconds[name], 2),
                   "decode_steps_tokens": decoded[name]} for name in engines}


def rounded_rows(rows: torch.Tensor, codes: torch.dtype, granularity: str) -> torch.Tensor:
    """rows rounded to `codes` with a per-tensor scale (1, or the rows' own largest value)
    or kv_cache_dtype's per-row one, back in rows' dtype."""
    if granularity == "token_head":
        return kv_quant.dequantize(kv_quant.quantize(rows, codes), rows.dtype)
    values = rows.float()
    scale = 1.0 if granularity == "tensor_scale_1" else float(values.abs().max()) / kv_quant.CODE_MAX[codes]
    scaled = (values / scale).clamp(-kv_quant.CODE_MAX[codes], kv_quant.CODE_MAX[codes])
    scaled = scaled.round() if codes == torch.int8 else scaled.to(codes).float()
    return (scaled * scale).to(rows.dtype)


def scale_granularity(args, token_ids: list[int]) -> dict:
    """Perplexity with K/V rounded at each granularity before a model-dtype store."""
    runner = ModelRunner(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                      enforce_eager=True))
    ops = runner.kernel_ops
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                          enforce_eager=True, max_model_len=len(token_ids) + 16)
    exact = EngineCore(config, runner=runner)  # the same path unrounded: the baseline
    results = {"none": round(perplexity(SimpleNamespace(engine=exact), token_ids,
                                        len(token_ids)), 3)}
    for name, codes in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2),
                        ("int8", torch.int8)):
        for granularity in ("tensor_scale_1", "tensor_amax", "token_head"):
            if codes == torch.int8 and granularity == "tensor_scale_1":
                continue  # int8 codes at scale 1 round every value to an integer: no model
            def store_kv(key, value, key_cache, value_cache, slots, codes=codes,
                         granularity=granularity):
                ops.store_kv(rounded_rows(key, codes, granularity),
                             rounded_rows(value, codes, granularity), key_cache, value_cache,
                             slots)
            bind_kernel_ops(runner.model, replace(ops, store_kv=store_kv))
            engine = EngineCore(config, runner=runner)
            results[f"{name}/{granularity}"] = round(
                perplexity(SimpleNamespace(engine=engine), token_ids, len(token_ids)), 3)
    bind_kernel_ops(runner.model, ops)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.set_defaults(dtype="bfloat16")
    parser.add_argument("--dtypes", default="auto,fp8,fp8_e5m2,int8",
                        help="kv_cache_dtype values; the first is the reference")
    parser.add_argument("--ppl-tokens", type=int, default=1024)
    parser.add_argument("--agreement-tokens", type=int, default=64)
    parser.add_argument("--decode-seqs", type=int, default=32)
    parser.add_argument("--context-tokens", type=int, default=2000)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--decode-memory-gb", type=float, default=4.0)
    parser.add_argument("--decode-dtypes", default="auto,fp8,int8",
                        help="the kv_cache_dtype values whose decode rate is measured")
    parser.add_argument("--skip-granularity", action="store_true")
    args = parser.parse_args()
    max_len = args.context_tokens + args.decode_tokens + 16
    bench = setup(args, max_model_len=max(max_len, args.ppl_tokens + 16))
    runner = bench.runner
    text = TEXT.read_text()
    ppl_tokens = runner.tokenizer(text, add_special_tokens=False)["input_ids"][:args.ppl_tokens]
    prompts = [runner.tokenizer(p)["input_ids"] for p in PROMPTS]
    rng = random.Random(args.seed)
    vocab = ordinary_token_ids(runner)
    long_prompts = [[rng.choice(vocab) for _ in range(args.context_tokens)]
                    for _ in range(args.decode_seqs)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()
    report = {"commit": commit, **bench.describe(),
              "perplexity_text": {"path": str(TEXT), "tokens": len(ppl_tokens),
                                  "sha256": hashlib.sha256(text.encode()).hexdigest()[:16]},
              "decode_workload": {"seqs": args.decode_seqs, "context_tokens": args.context_tokens,
                                  "decode_tokens": args.decode_tokens,
                                  "device_memory_gb": args.decode_memory_gb},
              "kv_cache_dtypes": {}}
    reference = None
    for kv_cache_dtype in args.dtypes.split(","):
        engine = bench.engine(kv_cache_dtype=kv_cache_dtype)
        plan = engine.memory_plan
        row = {"bytes_per_block": plan.bytes_per_block, "pool_blocks": plan.num_blocks,
               "blocks_vs_auto": round(plan.num_blocks / plan.auto_num_blocks, 3),
               "perplexity": round(perplexity(SimpleNamespace(engine=engine), ppl_tokens,
                                              len(ppl_tokens)), 3)}
        greedy = continuations(engine, prompts, args.agreement_tokens)
        reference = reference or greedy
        row["mean_first_divergence"] = sum(map(first_divergence, reference, greedy)) / len(greedy)
        report["kv_cache_dtypes"][kv_cache_dtype] = row
        print(kv_cache_dtype, row, file=sys.stderr, flush=True)
        del engine
    # Engines that step in turn need runners of their own: on one runner every engine would
    # read and write the KV cache of the last one made.
    decoding = {kv_cache_dtype: bench.engine_with_own_weights(
                    kv_cache_dtype=kv_cache_dtype, device_memory_gb=args.decode_memory_gb,
                    max_num_seqs=args.decode_seqs)
                for kv_cache_dtype in args.decode_dtypes.split(",")}
    for kv_cache_dtype, rates in decode_rates(decoding, long_prompts, args.decode_tokens).items():
        report["kv_cache_dtypes"].setdefault(kv_cache_dtype, {}).update(rates)
    del decoding
    auto = report["kv_cache_dtypes"].get("auto")
    if auto:
        for row in report["kv_cache_dtypes"].values():
            if "perplexity" in row:
                row["perplexity_vs_auto"] = round(row["perplexity"] / auto["perplexity"], 4)
            if "decode_tok_s" in row and "decode_tok_s" in auto:
                row["decode_vs_auto"] = round(row["decode_tok_s"] / auto["decode_tok_s"], 3)
    if not args.skip_granularity:
        report["scale_granularity"] = scale_granularity(args, ppl_tokens)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
