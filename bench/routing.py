"""Routing on N engine replicas: kv-aware against least-loaded and round-robin.

A multi-tenant workload: several system prompts of 500-1,000 tokens, each shared by many
requests (a short user turn after it), arriving interleaved at a fixed rate. Each
replica's pool (--num-gpu-blocks-override) holds about half the system prompts, so where a
request goes decides whether its prefix is cached. Each policy gets its own system prompts
and emptied pools. Prints JSON: per policy the prefix-cache hit rate (tokens), TTFT p50/p99
measured at the client (submit -> first token) and throughput.

    flock /work/bench.lock .venv/bin/python bench/routing.py            # a small random Llama
    flock /work/bench.lock .venv/bin/python bench/routing.py --model PATH
"""

import argparse
import dataclasses
import json
import random
import tempfile
import threading
import time
from pathlib import Path

from random_model import save_random_llama
from roofline import cpu_name

from kvscope.engine.config import EngineConfig  # noqa: E402
from kvscope.engine.replicas.hit_outcomes import HitTotals  # noqa: E402
from kvscope.engine.replicas.replica_set import ReplicaSet  # noqa: E402
from kvscope.engine.replicas.router import ROUTING_POLICIES  # noqa: E402
from kvscope.engine.sampling_params import SamplingParams  # noqa: E402

SETTLE_WAIT_S = 60.0  # for the replicas' last request records and block events


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="HF folder (default: a 4-layer random Llama made on the fly)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=4, help="system prompts")
    parser.add_argument("--requests-per-tenant", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, nargs=2, default=(500, 1000))
    parser.add_argument("--user-tokens", type=int, nargs=2, default=(16, 48))
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rate", type=float, default=4.0, help="arrivals per second")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="blocks per replica (default: about half the system prompts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+", choices=ROUTING_POLICIES,
                        default=list(ROUTING_POLICIES))
    return parser.parse_args(argv)


def workload(rng: random.Random, args, vocab_size: int) -> tuple[list[int], list[list[int]]]:
    """Each request's tenant and prompt, in arrival order: tenants interleaved at random,
    each tenant's requests sharing its system prompt."""
    systems = [[rng.randrange(vocab_size) for _ in range(rng.randint(*args.system_tokens))]
               for _ in range(args.tenants)]
    order = [t for t in range(args.tenants) for _ in range(args.requests_per_tenant)]
    rng.shuffle(order)
    return order, [systems[t] + [rng.randrange(vocab_size)
                                 for _ in range(rng.randint(*args.user_tokens))] for t in order]


def run_policy(replicas: ReplicaSet, policy: str, tenants: list[int], prompts: list[list[int]],
               args) -> dict:
    replicas.set_routing(policy)
    # Empty pools: the same knobs rebuild every replica's KV cache.
    replicas.reconfigure(num_gpu_blocks_override=replicas.config.num_gpu_blocks_override)
    before = replicas.counters()
    hits_before = replicas.router_view().totals
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    ttfts: list[float] = []
    threads = []
    request_ids = set()
    lock = threading.Lock()

    def consume(stream, submitted: float) -> None:
        first = None
        for output in stream:
            if first is None and output.outputs[0].token_ids:
                first = time.perf_counter() - submitted
        with lock:
            ttfts.append(first)

    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        time.sleep(max(0.0, started + index / args.rate - time.perf_counter()))
        stream = replicas.submit(prompt, params)
        request_ids.add(stream.request_id)
        thread = threading.Thread(target=consume, args=(stream, time.perf_counter()))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    time.sleep(1.0)  # the replicas' last counters arrive with their next event poll
    after = replicas.counters()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    decisions = list(replicas.recent_decisions)[-len(prompts):]
    ordered = sorted(ttfts)
    return {
        "policy": policy,
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
        "ttft_p50_s": round(ordered[len(ordered) // 2], 4),
        "ttft_p99_s": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 4),
        "throughput_tokens_per_s": round(len(prompts) * args.max_tokens / elapsed, 2),
        "requests_per_s": round(len(prompts) / elapsed, 3),
        "wall_s": round(elapsed, 2),
        "requests_per_replica": [sum(d.replica == r for d in decisions)
                                 for r in range(replicas.num_replicas)],
        # Per tenant, its requests on each replica: kv-aware should keep a tenant on one.
        "tenant_requests_per_replica": [
            [sum(d.replica == r for d, t in zip(decisions, tenants, strict=True) if t == tenant)
             for r in range(replicas.num_replicas)] for tenant in range(args.tenants)],
        "preemptions": after.preemptions - before.preemptions,
        "router_belief": router_belief(replicas, hits_before, request_ids),
    }


def router_belief(replicas: ReplicaSet, before: HitTotals, request_ids: set[str]) -> dict:
    """The run's predicted hits against the actual ones: summed over its requests' outcomes
    and read from the router's counters (the two must agree), and the index beside each
    replica's cache once idle."""
    deadline = time.monotonic() + SETTLE_WAIT_S
    view = replicas.router_view()
    while view.totals.requests - before.requests < len(request_ids) and (
            time.monotonic() < deadline):
        time.sleep(0.5)
        view = replicas.router_view()
    while any(c.events_behind for c in view.replicas) and time.monotonic() < deadline:
        time.sleep(0.5)
        view = replicas.router_view()
    counters = view.totals.since(before)
    summed = HitTotals()
    for outcome in view.outcomes:
        if outcome.request_id in request_ids and outcome.actual_tokens is not None:
            summed.add(outcome)
    return {"counters": dataclasses.asdict(counters),
            "outcome_sums_equal_counters": summed == counters,
            "index_vs_cache": [dataclasses.asdict(c) for c in view.replicas]}


def main(argv=None) -> None:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    # hidden 256, 4 layers, 4k vocab: prefill costs enough to show in TTFT on a CPU.
    model = args.model or str(save_random_llama(
        Path(tempfile.mkdtemp(prefix="kvscope-routing-")), vocab_size=4096, hidden_size=256,
        intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=4, max_positions=2048))
    system_blocks = args.tenants * sum(args.system_tokens) / 2 / args.block_size
    blocks = args.num_gpu_blocks_override or int(system_blocks / args.replicas * 1.25)
    # The longest request fits (a longer max_model_len than the small pool holds is refused).
    max_model_len = args.system_tokens[1] + args.user_tokens[1] + args.max_tokens
    config = EngineConfig(model=model, dtype="float32", device="cpu", block_size=args.block_size,
                          num_gpu_blocks_override=blocks, max_model_len=max_model_len)
    replicas = ReplicaSet(config, args.replicas)
    try:
        vocab_size = len(replicas.tokenizer)
        results = [run_policy(replicas, policy, *workload(rng, args, vocab_size), args)
                   for policy in args.policies]
    finally:
        replicas.shutdown()
    by_policy = {result["policy"]: result for result in results}
    kv, rr = by_policy.get("kv-aware"), by_policy.get("round-robin")
    compared = kv is not None and rr is not None
    print(json.dumps({
        "cpu": cpu_name(), "shared_machine": True,
        "model": args.model or "random Llama (hidden 256, 4 layers, 4k vocab), float32",
        "replicas": args.replicas, "blocks_per_replica": blocks,
        "block_size": args.block_size, "tenants": args.tenants,
        "requests": args.tenants * args.requests_per_tenant, "rate_per_s": args.rate,
        "results": results,
        "kv_aware_hit_rate_over_round_robin": (
            round(kv["prefix_cache_hit_rate"] / rr["prefix_cache_hit_rate"], 3)
            if compared and rr["prefix_cache_hit_rate"] else None),
        "kv_aware_ttft_p50_over_round_robin": (
            round(kv["ttft_p50_s"] / rr["ttft_p50_s"], 3) if compared else None),
    }, indent=2))


if __name__ == "__main__":
    main()
