"""Speculative decoding (n-gram prompt lookup) off vs on, one run, one machine, the
default model: output tokens/s, acceptance rate and tokens per verifying forward.

  copy      copy-heavy single streams: each prompt gives a passage of this repository's
            docs and asks for it back copied, quoted, re-wrapped or with its typos fixed
            (completion-style prompts: the small default model copies reliably only so);
            one request at a time, greedy. Also reported against the memory roofline:
            tok/s x weight bytes one forward reads / measured read bandwidth (> 1.0: one
            stream decoding faster than reading the weights once per token allows)
  chat      open-ended chat questions, batched, greedy (little to copy: must not lose)
  throughput  bench/throughput.py's default workload (random prompts, 64 requests)

Every workload's greedy outputs are compared with speculation off and on
(outputs_equal). On the C++ kernels each row of a verification chunk computes bit for bit
what a decode of its token computes, so one stream's outputs are equal in bfloat16 too. A
batch of verifications is more rows than the streaming linears take and goes through GEMM,
which rounds by batch shape: there bfloat16 outputs can drift apart after a near-tie, as
batch composition moves decode outputs without speculation. In float32 the tests find
them equal token for token.

Usage:
  python bench/speculative.py                      # all three
  python bench/speculative.py --workloads copy --num-copy-prompts 8
"""

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import roofline  # noqa: E402
import throughput  # noqa: E402
import torch  # noqa: E402

from kvscope import LLM, SamplingParams  # noqa: E402
from kvscope.engine.spec_decode.metrics import SpecDecodingStats  # noqa: E402

logger = logging.getLogger("bench.speculative")
WORKLOADS = ("copy", "chat", "throughput")
DOCS = Path(__file__).resolve().parent.parent / "docs"
TASKS = (
    "Text:\n{text}\n\nThe same text, copied exactly:\n{start}",
    "Passage:\n{text}\n\nQuote the passage above in full:\n\"{start}",
    "Draft:\n{text}\n\nThe draft re-wrapped, its wording unchanged:\n{start}",
    "Notes with typos:\n{typos}\n\nThe notes with the typos fixed:\n{start}",
)
CHAT = [
    "What makes a good cup of coffee?", "Tell me a short story about a lighthouse keeper.",
    "Why is the sky blue?", "Give me three ideas for a rainy afternoon.",
    "How do bees make honey?", "What should I pack for a weekend hike?",
    "Explain what a black hole is to a child.", "Write a haiku about autumn leaves.",
]


def copy_prompts(tokenizer, count: int) -> list[str]:
    """Passages of ~300-500 tokens cut at paragraph breaks from docs/, each with a task."""
    paragraphs = [p for name in ("architecture.md", "performance.md")
                  for p in (DOCS / name).read_text().split("\n\n")
                  if len(p) > 200 and not p.lstrip().startswith(("```", "|"))]
    prompts, index = [], 0
    while len(prompts) < count:
        passage = []
        while len(tokenizer("\n\n".join(passage)).input_ids) < 300:
            passage.append(paragraphs[index % len(paragraphs)])
            index += 1
        text = "\n\n".join(passage)
        task = TASKS[len(prompts) % len(TASKS)]
        prompts.append(task.format(text=text, typos=text.replace(" the ", " teh "),
                                   start=text[:30]))
    return prompts


def measure(llm: LLM, prompts, params: SamplingParams, one_at_a_time: bool,
            chat: bool = False) -> tuple[dict, list[list[int]]]:
    engine = llm.engine
    if engine.config.enable_prefix_caching:
        engine.kv_cache.pool.reset_cache()
    stats, forwards = SpecDecodingStats(), 0
    records: list = []
    step = engine.step

    def recording_step():
        result = step()
        records.append(result.record)
        return result

    engine.step = recording_step
    batches = [[p] for p in prompts] if one_at_a_time else [prompts]
    started = time.perf_counter()
    outputs = []
    for batch in batches:
        if chat:
            outputs += llm.chat([[{"role": "user", "content": p}] for p in batch], params,
                                use_tqdm=False)
        else:
            outputs += llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    del engine.step
    for record in records:
        stats.observe(record.spec_drafts)
        forwards += sum(1 for chunk in record.chunks if chunk[2] == "decode")
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    generated = sum(len(t) for t in tokens)
    return {"seconds": round(seconds, 2), "output_tokens": generated,
            "output_tokens_per_s": round(generated / seconds, 2),
            "decode_chunks": forwards,
            "tokens_per_decode_forward": round(generated / max(forwards, 1), 3),
            "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "acceptance_rate": round(stats.acceptance_rate, 3),
            "accepted_per_position": stats.num_accepted_tokens_per_pos}, tokens


def compare(name: str, engines: dict[str, LLM], prompts, params, one_at_a_time: bool,
            chat: bool = False) -> dict:
    results, outputs = {}, {}
    for mode, llm in engines.items():
        logger.info("%s: speculation %s", name, mode)
        results[mode], outputs[mode] = measure(llm, prompts, params, one_at_a_time, chat)
        logger.info("%s %s: %s", name, mode, results[mode])
    return {"off": results["off"], "on": results["on"],
            "outputs_equal": outputs["off"] == outputs["on"],
            "speedup": round(results["on"]["output_tokens_per_s"]
                             / results["off"]["output_tokens_per_s"], 3)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--speculative-config", type=json.loads,
                        default={"method": "ngram", "num_speculative_tokens": 4,
                                 "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    parser.add_argument("--num-copy-prompts", type=int, default=16)
    parser.add_argument("--copy-output", type=int, default=128)
    parser.add_argument("--chat-output", type=int, default=96)
    parser.add_argument("--throughput-requests", type=int, default=64,
                        help="bench/throughput.py's default is 64; fewer to keep a run short")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    engines = {"off": LLM(args.model, max_model_len=2048),
               "on": LLM(args.model, max_model_len=2048,
                         speculative_config=args.speculative_config)}
    runner = engines["off"].engine.runner
    tokenizer = runner.tokenizer
    for llm in engines.values():  # untimed: first calls' one-time costs
        llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)
    report = {"model": str(runner.model_path), "dtype": str(runner.dtype),
              "torch_threads": torch.get_num_threads(),
              "speculative_config": engines["on"].engine.config.speculative_config.to_dict(),
              "results": {}}
    if "copy" in workloads:
        prompts = copy_prompts(tokenizer, args.num_copy_prompts)
        lengths = [len(tokenizer(p).input_ids) for p in prompts]
        result = compare("copy", engines, prompts,
                         SamplingParams(temperature=0, max_tokens=args.copy_output), True)
        bandwidth = roofline.measure()["read_bandwidth_gb_s"] * 1e9
        weight_bytes = report["weight_bytes_per_forward"] = runner.weight_bytes  # tied
        report["read_bandwidth_gb_s"] = round(bandwidth / 1e9, 2)
        for mode in ("off", "on"):
            result[mode]["share_of_bandwidth_limit"] = round(
                result[mode]["output_tokens_per_s"] * weight_bytes / bandwidth, 3)
        result["prompts"] = {"count": len(prompts), "min_tokens": min(lengths),
                             "max_tokens": max(lengths), "one_request_at_a_time": True}
        report["results"]["copy"] = result
    if "chat" in workloads:
        report["results"]["chat"] = compare(
            "chat", engines, CHAT, SamplingParams(temperature=0, max_tokens=args.chat_output),
            False, chat=True)
        report["results"]["chat"]["prompts"] = {"count": len(CHAT), "batched": True}
    if "throughput" in workloads:
        defaults = throughput.parse_args([])
        defaults.num_requests = args.throughput_requests
        workload = throughput.make_workload(defaults, tokenizer, runner.hf_config.vocab_size)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                  for n in workload.output_lens]
        result = compare("throughput", engines, workload.prompts, params, False)
        result["workload"] = workload.describe(defaults)
        report["results"]["throughput"] = result
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
