"""Speculative decoding (n-gram prompt lookup) off vs on, one run, one machine, the
default model in bfloat16 (--dtype): output tokens/s, acceptance rate and tokens per
verifying forward; decode_step_ms gives the decode steps' median time by their sequences
and proposed tokens ("8+4": eight sequences, four proposals among them).

  copy      copy-heavy single streams: each prompt gives a passage of this repository's
            docs and asks for it back copied, quoted, re-wrapped or with its typos fixed
            (completion-style prompts: the small default model copies reliably only so);
            one request at a time, greedy. Also reported against the memory roofline:
            tok/s x weight bytes one forward reads / measured read bandwidth (> 1.0: one
            stream decoding faster than reading the weights once per token allows), over
            the whole run (prefills included) and over the decode steps alone (decode_*)
  chat      open-ended chat questions, batched, greedy (little to copy: must not lose)
  throughput  bench/throughput.py's default workload (random prompts, 64 requests)
  draft     method='draft_model' on one stream of copy prompts, its cost per step: the
            draft is the default model's shape with fewer layers (--draft-layers) and
            random weights, so its acceptance means nothing; reported are the draft's
            time per step (its k+1 forwards), the whole step's, and a decode step's
            without speculation. --draft-copy also runs the target as its own draft
            (every greedy proposal accepted where the rows compute alike: an upper bound
            for acceptance at the cost of a draft as large as the target)
  rows      what a verification costs: the target's forward over r query tokens of one
            sequence (r = 1, 2, 3, 5, 9: k + 1 for k = 0, 1, 2, 4, 8) at position 400, its
            median time against one row's, alternated so drifts of a shared machine hit
            every r alike

Every workload's greedy outputs are compared with speculation off and on
(outputs_equal). On the C++ kernels each row of a verification chunk computes bit for bit
what a decode of its token computes, so one stream's outputs are equal in bfloat16 too, and
a batch's while its verifications fit the streaming linears (32 rows). More rows go through
GEMM, which rounds by batch shape: there bfloat16 outputs can drift apart after a near-tie,
as batch composition moves decode outputs without speculation. In float32 the tests find
them equal token for token.

Usage:
  python bench/speculative.py                      # all three
  python bench/speculative.py --workloads copy --num-copy-prompts 8
  python bench/speculative.py --workloads chat,copy --fixed-k-too --rounds 3  # adaptive_k
  python bench/speculative.py --workloads draft --num-copy-prompts 2 --draft-copy
"""

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import roofline  # noqa: E402
import throughput  # noqa: E402
import torch  # noqa: E402
from served import cpu_name  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from kvscope import LLM, SamplingParams  # noqa: E402
from kvscope.engine.spec_decode.metrics import SpecDecodingStats  # noqa: E402

logger = logging.getLogger("bench.speculative")
WORKLOADS = ("copy", "chat", "throughput")  # and "draft" and "rows", on request
VERIFY_ROWS = (1, 2, 3, 5, 9)
RATES = ("output_tokens_per_s", "decode_tokens_per_s")  # medians over --rounds
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
    """Passages of 300-600 tokens (the issue's prompts) cut at paragraph breaks from docs/,
    each with a task: paragraphs of at most 300 tokens, joined until 300 are reached."""
    paragraphs = [p for name in ("architecture.md", "performance-history.md")
                  for p in (DOCS / name).read_text().split("\n\n")
                  if len(p) > 200 and not p.lstrip().startswith(("```", "|"))
                  and len(tokenizer(p).input_ids) <= 300]
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
    decode_seconds = decode_tokens = 0.0  # steps that only decoded (or verified)
    by_shape: dict[tuple[int, int], list[float]] = {}  # (sequences, proposed): step ms
    for record in records:
        stats.observe(record.spec_drafts)
        forwards += sum(1 for chunk in record.chunks if chunk[2] == "decode")
        if all(chunk[2] == "decode" for chunk in record.chunks):
            decode_seconds += record.end_time - record.start_time
            decode_tokens += record.num_generated_tokens
            shape = (len(record.chunks), sum(draft[1] for draft in record.spec_drafts))
            by_shape.setdefault(shape, []).append(1e3 * (record.end_time - record.start_time))
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    generated = sum(len(t) for t in tokens)
    return {"seconds": round(seconds, 2), "output_tokens": generated,
            "output_tokens_per_s": round(generated / seconds, 2),
            "decode_seconds": round(decode_seconds, 2),
            "decode_tokens_per_s": round(decode_tokens / max(decode_seconds, 1e-9), 2),
            "decode_chunks": forwards,
            "tokens_per_decode_forward": round(generated / max(forwards, 1), 3),
            "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "acceptance_rate": round(stats.acceptance_rate, 3),
            "accepted_per_position": stats.num_accepted_tokens_per_pos,
            # "sequences+proposed": median ms of the decode steps of that shape (3 or more)
            "decode_step_ms": {f"{sequences}+{proposed}": round(statistics.median(times), 2)
                               for (sequences, proposed), times in sorted(by_shape.items())
                               if len(times) >= 3}}, tokens


def compare(name: str, engines: dict[str, LLM], prompts, params, one_at_a_time: bool,
            chat: bool = False, rounds: int = 1) -> dict:
    """Each mode's run of the workload, the modes alternated `rounds` times (in turn order,
    then reversed, and so on) so that a shared machine's drifts hit each alike. Both rates
    (output and decode-phase tok/s) are the median over rounds, each round's listed; the
    other fields are the last round's."""
    results, outputs = {}, {}
    per_round = {mode: {rate: [] for rate in RATES} for mode in engines}
    for round_index in range(rounds):
        order = list(engines.items())
        for mode, llm in order if round_index % 2 == 0 else order[::-1]:
            logger.info("%s: speculation %s", name, mode)
            results[mode], outputs[mode] = measure(llm, prompts, params, one_at_a_time, chat)
            for rate in RATES:
                per_round[mode][rate].append(results[mode][rate])
            logger.info("%s %s: %s", name, mode, results[mode])
    for mode, rates in per_round.items():
        for rate, values in rates.items():
            results[mode][rate] = round(statistics.median(values), 2)
            results[mode][rate + "_rounds"] = values
    report = dict(results)
    for mode in results:
        if mode != "off":  # "on" -> outputs_equal, speedup; "on_fixed_k" -> ..._fixed_k
            suffix = mode.removeprefix("on")
            report["outputs_equal" + suffix] = outputs["off"] == outputs[mode]
            report["speedup" + suffix] = round(results[mode]["output_tokens_per_s"]
                                               / results["off"]["output_tokens_per_s"], 3)
    return report


def save_shaped_draft(folder: Path, runner, num_layers: int) -> Path:
    """The target's architecture and tokenizer with `num_layers` layers of random bf16
    weights: what a draft model of that depth costs, whatever it proposes."""
    config = type(runner.hf_config).from_dict(runner.hf_config.to_dict())
    config.num_hidden_layers = num_layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    runner.tokenizer.save_pretrained(folder)
    return folder


def step_costs(llm: LLM, prompts, params: SamplingParams) -> dict:
    """One stream of `prompts`, one after another: mean milliseconds per decode step, and
    with a draft model the part of it its proposals took."""
    engine = llm.engine
    engine.kv_cache.pool.reset_cache()
    proposer = getattr(engine.runner, "proposer", None)
    draft_total = [0.0]  # seconds in the draft's forwards so far
    if proposer is not None:
        run = proposer.run

        def timed_run(scheduled):
            started = time.perf_counter()
            run(scheduled)
            draft_total[0] += time.perf_counter() - started

        proposer.run = timed_run
    step, steps, stats = engine.step, [], SpecDecodingStats()

    def timed_step():
        started, draft_before = time.perf_counter(), draft_total[0]
        result = step()
        if all(chunk[2] == "decode" for chunk in result.record.chunks):
            steps.append((time.perf_counter() - started, draft_total[0] - draft_before))
        stats.observe(result.record.spec_drafts)
        return result

    engine.step = timed_step
    generated = 0
    for prompt in prompts:
        generated += len(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    del engine.step
    result = {"decode_steps": len(steps), "output_tokens": generated,
              "acceptance_rate": round(stats.acceptance_rate, 3),
              "tokens_per_step": round(generated / max(len(steps), 1), 3),
              "step_ms": round(1e3 * statistics.mean(s for s, _ in steps), 2)}
    if proposer is not None:
        del proposer.run
        result["draft_ms"] = round(1e3 * statistics.mean(d for _, d in steps), 2)
        result["verify_ms"] = round(result["step_ms"] - result["draft_ms"], 2)
        result["draft_weight_mb"] = round(proposer.runner.weight_bytes / 1e6, 1)
    return result


def draft_costs(args, off: LLM, prompts) -> dict:
    """Decode steps without speculation and with a draft model (and the target as its own
    draft, if asked): what proposing k tokens by a draft costs per step."""
    k = args.speculative_config.get("num_speculative_tokens", 4)
    params = SamplingParams(temperature=0, max_tokens=args.copy_output)
    report = {"off": step_costs(off, prompts, params)}
    with tempfile.TemporaryDirectory() as folder:
        drafts = {f"random_{args.draft_layers}_layers":
                  str(save_shaped_draft(Path(folder), off.engine.runner, args.draft_layers))}
        if args.draft_copy:
            drafts["target_copy"] = str(off.engine.runner.model_path)
        for name, path in drafts.items():
            llm = LLM(args.model, dtype=args.dtype, max_model_len=2048, speculative_config={
                "model": path, "num_speculative_tokens": k, "min_acceptance_rate": 0.0,
                "adaptive_k": False})
            llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)
            report[name] = step_costs(llm, prompts, params)
            logger.info("draft %s: %s", name, report[name])
            report[name]["draft_ms_per_forward"] = round(report[name]["draft_ms"] / (k + 1), 2)
            report[name]["step_vs_decode"] = round(report[name]["step_ms"]
                                                   / report["off"]["step_ms"], 3)
            del llm
    report["num_speculative_tokens"] = k
    return report


def verification_rows(runner, repeats: int = 25, position: int = 400) -> dict:
    """Median forward time of r rows of one sequence (with their logits), and its ratio to
    one row's: what verifying k = r - 1 proposals costs against a decode."""
    table = list(range(-(-(position + max(VERIFY_ROWS)) // runner.block_size)))
    seconds: dict[int, list[float]] = {rows: [] for rows in VERIFY_ROWS}
    for _ in range(repeats):
        for rows in VERIFY_ROWS:
            started = time.perf_counter()
            runner.forward_rows([(position, position + rows, table)], [[100] * rows],
                                list(range(rows)))
            seconds[rows].append(time.perf_counter() - started)
    one = statistics.median(seconds[1])
    return {rows: {"median_ms": round(1e3 * statistics.median(values), 2),
                   "vs_one_row": round(statistics.median(values) / one, 3)}
            for rows, values in seconds.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--dtype", default="bfloat16",
                        help="the issue's measurements are in bfloat16 (auto would pick "
                             "float32 on a CPU without native bf16)")
    parser.add_argument("--speculative-config", type=json.loads,
                        default={"method": "ngram", "num_speculative_tokens": 4,
                                 "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    parser.add_argument("--num-copy-prompts", type=int, default=16)
    parser.add_argument("--copy-output", type=int, default=128)
    parser.add_argument("--chat-output", type=int, default=96)
    parser.add_argument("--throughput-requests", type=int, default=64,
                        help="bench/throughput.py's default is 64; fewer to keep a run short")
    parser.add_argument("--draft-layers", type=int, default=4,
                        help="the random draft's depth (the default model has 30 layers)")
    parser.add_argument("--draft-copy", action="store_true",
                        help="also run the target as its own draft")
    parser.add_argument("--rounds", type=int, default=1,
                        help="alternate the modes this many times (copy, chat, throughput)")
    parser.add_argument("--fixed-k-too", action="store_true",
                        help="also run the speculative config with adaptive_k off (every "
                             "sequence proposes num_speculative_tokens): on_fixed_k")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    engines = {"off": LLM(args.model, dtype=args.dtype, max_model_len=2048)}
    if set(workloads) & set(WORKLOADS):
        engines["on"] = LLM(args.model, dtype=args.dtype, max_model_len=2048,
                            speculative_config=args.speculative_config)
        if args.fixed_k_too:
            engines["on_fixed_k"] = LLM(
                args.model, dtype=args.dtype, max_model_len=2048,
                speculative_config={**args.speculative_config, "adaptive_k": False})
    runner = engines["off"].engine.runner
    tokenizer = runner.tokenizer
    for llm in engines.values():  # untimed: first calls' one-time costs
        llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)
    report = {"cpu": cpu_name(), "model": str(runner.model_path), "dtype": str(runner.dtype),
              "torch_threads": torch.get_num_threads(),
              "speculative_config": (engines["on"].engine.config.speculative_config.to_dict()
                                     if "on" in engines else args.speculative_config),
              "results": {}}
    if "copy" in workloads:
        prompts = copy_prompts(tokenizer, args.num_copy_prompts)
        lengths = [len(tokenizer(p).input_ids) for p in prompts]
        result = compare("copy", engines, prompts,
                         SamplingParams(temperature=0, max_tokens=args.copy_output), True,
                         rounds=args.rounds)
        bandwidth = roofline.measure()["read_bandwidth_gb_s"] * 1e9
        weight_bytes = report["weight_bytes_per_forward"] = runner.weight_bytes  # tied
        report["read_bandwidth_gb_s"] = round(bandwidth / 1e9, 2)
        for mode in engines:
            for share, rate in (("share_of_bandwidth_limit", "output_tokens_per_s"),
                                ("decode_share_of_bandwidth_limit", "decode_tokens_per_s")):
                result[mode][share] = round(result[mode][rate] * weight_bytes / bandwidth, 3)
        result["prompts"] = {"count": len(prompts), "min_tokens": min(lengths),
                             "max_tokens": max(lengths), "one_request_at_a_time": True}
        report["results"]["copy"] = result
    if "chat" in workloads:
        report["results"]["chat"] = compare(
            "chat", engines, CHAT, SamplingParams(temperature=0, max_tokens=args.chat_output),
            False, chat=True, rounds=args.rounds)
        report["results"]["chat"]["prompts"] = {"count": len(CHAT), "batched": True}
    if "throughput" in workloads:
        defaults = throughput.parse_args([])
        defaults.num_requests = args.throughput_requests
        workload = throughput.make_workload(defaults, tokenizer, runner.hf_config.vocab_size)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                  for n in workload.output_lens]
        result = compare("throughput", engines, workload.prompts, params, False,
                         rounds=args.rounds)
        result["workload"] = workload.describe(defaults)
        report["results"]["throughput"] = result
    if "rows" in workloads:
        report["results"]["rows"] = verification_rows(runner)
    if "draft" in workloads:
        report["results"]["draft"] = draft_costs(
            args, engines["off"], copy_prompts(tokenizer, args.num_copy_prompts))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
