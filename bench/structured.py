"""Structured outputs: a JSON-schema workload vs the same workload unconstrained.

32 chat requests (by default) ask the default model for a small JSON object. They run
twice on one engine, greedy:

  json_schema     structured_outputs=json (a small object schema, compact whitespace)
  unconstrained   no constraint, each request generating exactly as many tokens as its
                  constrained twin did (ignore_eos), so both runs produce the same tokens

Prints JSON: output tokens/s of both runs and their ratio (target >= 0.7), the same by
the process's CPU time (steadier on a shared machine), how many constrained outputs
parse and validate against the schema (target: all), and the time of the untimed warm-up
request, which builds llguidance's tokenizer (once per process).

Usage:
  python bench/structured.py
  python bench/structured.py --num-requests 64 --repeats 3
  python bench/structured.py --threads 1    # shared machine: compare by CPU time
"""

import argparse
import json
import logging
import os
import platform
import sys
import time

import jsonschema

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch

from kvscope import LLM, SamplingParams  # noqa: E402
from kvscope.engine.sampling_params import StructuredOutputsParams  # noqa: E402

logger = logging.getLogger("bench.structured")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "student": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "student"],
    "additionalProperties": False,
}
TOPICS = ["a pilot", "a baker", "a chess player", "a nurse", "a painter", "a farmer",
          "a poet", "a sailor"]


def conversations(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} number {i} as a "
              "JSON object with name, age, city and student."}] for i in range(count)]


def timed_chat(llm: LLM, prompts, params) -> tuple[float, float, list]:
    """Wall seconds, seconds of the process's CPU time (steadier on a shared machine;
    llguidance's mask threads count too) and the outputs."""
    llm.engine.kv_cache.pool.reset_cache()  # no run reuses another's prompt blocks
    started, cpu_started = time.perf_counter(), time.process_time()
    outputs = llm.chat(prompts, params, use_tqdm=False)
    return time.perf_counter() - started, time.process_time() - cpu_started, outputs


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2, help="best of, round-robin")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    llm = LLM(args.model)
    prompts = conversations(args.num_requests)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    # Warm-up, untimed like model loading: the first constrained request also builds
    # llguidance's tokenizer, once per process; its time is reported on its own.
    started = time.perf_counter()
    llm.chat(prompts[:1], SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(
        json=SCHEMA)), use_tqdm=False)
    first_request_seconds = time.perf_counter() - started
    runs: dict[str, list[float]] = {"json_schema": [], "unconstrained": []}
    cpu_runs: dict[str, list[float]] = {"json_schema": [], "unconstrained": []}
    for repeat in range(args.repeats):
        seconds, cpu_seconds, outputs = timed_chat(llm, prompts, constrained)
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        runs["json_schema"].append(sum(lengths) / seconds)
        cpu_runs["json_schema"].append(sum(lengths) / cpu_seconds)
        free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        seconds, cpu_seconds, _ = timed_chat(llm, prompts, free)
        runs["unconstrained"].append(sum(lengths) / seconds)
        cpu_runs["unconstrained"].append(sum(lengths) / cpu_seconds)
        logger.info("repeat %d: %s", repeat + 1, {k: round(v[-1], 1) for k, v in runs.items()})
    valid = 0
    for output in outputs:
        try:
            jsonschema.validate(json.loads(output.outputs[0].text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as error:
            logger.warning("invalid output %r: %s", output.outputs[0].text, error)
    best = {name: max(values) for name, values in runs.items()}
    best_cpu = {name: max(values) for name, values in cpu_runs.items()}
    print(json.dumps({
        "model": str(llm.engine.runner.model_path), "dtype": str(llm.engine.runner.dtype),
        "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(), "num_requests": args.num_requests,
        "schema": SCHEMA, "output_tokens": sum(lengths),
        "first_constrained_request_s": round(first_request_seconds, 2),
        "output_tokens_per_s": {name: round(value, 1) for name, value in best.items()},
        "all_output_tokens_per_s": {k: [round(v, 1) for v in vs] for k, vs in runs.items()},
        "json_schema_vs_unconstrained": round(best["json_schema"] / best["unconstrained"], 3),
        "output_tokens_per_cpu_s": {name: round(value, 1) for name, value in best_cpu.items()},
        "json_schema_vs_unconstrained_by_cpu_time": round(
            best_cpu["json_schema"] / best_cpu["unconstrained"], 3),
        "valid_outputs": f"{valid}/{len(outputs)}",
        "finish_reasons": sorted({str(o.outputs[0].finish_reason) for o in outputs}),
        "example": outputs[0].outputs[0].text,
    }, indent=2))


if __name__ == "__main__":
    main()
