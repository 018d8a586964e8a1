"""Priority scheduling against fcfs on one overloaded trace, live on a small random model.

A mixed trace (10 % high priority, 0; the rest low, 1) arrives faster than the engine
serves it, into a pool too small for the running batch, so requests queue and preempt. The
same trace runs under --scheduling-policy fcfs and priority (engine.replay, live clock).
Reported as JSON:
  - high-priority TTFT p99, fcfs over priority (target >= 3x);
  - low priority under priority: every request finished, its longest wait, and the aging
    bound checked: no high-priority request that arrived more than priority_aging_steps
    scheduler steps after a low one started before it (engine/core/scheduling_policy.py);
  - throughput cost, 1 - priority's output tokens/s over fcfs's (target <= 5 %): over the
    means of the runs, and the median over each alternation's pair of runs (a burst of load
    elsewhere moves one pair, not the median); and the same over output tokens per CPU
    second the process spent from a run's first step to its last, which other processes'
    load moves far less than seconds of wall clock (it still moves the trace: a slower
    engine serves larger batches); and the scheduler's own CPU per step (Scheduler.schedule
    timed on its thread) and its share of the run's CPU, the part a policy adds by itself;
  - over the first priority run: preemptions, by reason, and the share carrying a reason, a
    victim and a taker (target 100 %).

Usage (the machine is shared; under the bench lock where there is one):
  flock /work/bench.lock .venv/bin/python bench/priority.py
  python bench/priority.py --requests 200          # a quicker look
"""

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from random_model import save_random_llama
from roofline import cpu_name

from kvscope.engine.config import EngineConfig  # noqa: E402
from kvscope.engine.core.scheduler import Scheduler  # noqa: E402
from kvscope.engine.replay.metrics import RunResult  # noqa: E402
from kvscope.engine.replay.runner import ReplaySession  # noqa: E402
from kvscope.engine.replay.workload import ReplayRequest, Workload  # noqa: E402

HIGH, LOW = 0, 1
VOCAB_SIZE = 1024


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--high-share", type=float, default=0.1)
    parser.add_argument("--rate", type=float, default=400.0,
                        help="arrivals per second (Poisson): above what the engine serves")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(24, 96))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(8, 32))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=48,
                        help="the pool: well under what max-num-seqs requests grow to")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--aging-steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each policy")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def trace(args) -> Workload:
    rng = random.Random(args.seed)
    requests, now = [], 0.0
    for index in range(args.requests):
        now += rng.expovariate(args.rate)
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(*args.prompt_tokens))]
        requests.append(ReplayRequest(
            f"r{index}", now, prompt, rng.randint(*args.output_tokens),
            priority=HIGH if rng.random() < args.high_share else LOW))
    return Workload("priority-mix", requests)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def arrival_steps(run: RunResult) -> dict[str, int]:
    """The scheduler step each request was queued before: the replay adds a request once
    a step ends at or after its arrival, before the next step (or before the first)."""
    ends = [sample.end_s for sample in run.steps]
    steps, index = {}, 0
    for timing in sorted(run.requests, key=lambda t: t.arrival_s):
        while index < len(ends) and ends[index] < timing.arrival_s:
            index += 1
        steps[timing.request_id] = index + 1 if timing.arrival_s > 0 else 0
    return steps


def first_scheduled_steps(run: RunResult) -> dict[str, int]:
    first: dict[str, int] = {}
    for index, record in enumerate(run.records):
        for request_id, *_ in record.chunks:
            first.setdefault(request_id, index)
    return first


class ScheduleTimer:
    """Scheduler.schedule's CPU seconds on its own thread (thread_time: pure Python on the
    engine thread, so other processes' load barely moves it), summed while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._schedule = Scheduler.schedule

    def __enter__(self) -> "ScheduleTimer":
        timer, schedule = self, self._schedule

        def timed(scheduler):
            start = time.thread_time()
            try:
                return schedule(scheduler)
            finally:
                timer.seconds += time.thread_time() - start

        Scheduler.schedule = timed
        return self

    def __exit__(self, *exc) -> None:
        Scheduler.schedule = self._schedule


def timed_run(session: ReplaySession, policy: str) -> tuple[RunResult, float, float]:
    """One run, the CPU seconds the process spent from its first step to its last, and the
    scheduler's share of them."""
    marks: list[float] = []
    with ScheduleTimer() as timer:
        run = session.run({"scheduling_policy": policy},
                          progress=lambda done, total: marks.append(time.process_time()))
    return run, marks[-1] - marks[0], timer.seconds


def summary(runs: list[RunResult], cpu_seconds: list[float], schedule_seconds: list[float],
            priorities: dict[str, int]) -> dict:
    """One policy's repeats: latencies pooled over them, throughput their mean."""
    timings = [t for run in runs for t in run.requests]
    high = [t.ttft_s for t in timings if priorities[t.request_id] == HIGH]
    low = [t for t in timings if priorities[t.request_id] == LOW]
    rates = [sum(t.num_output_tokens for t in run.requests)
             / max(t.finished_s for t in run.requests) for run in runs]
    return {
        "high_ttft_p50_s": round(percentile(high, 0.5), 4),
        "high_ttft_p99_s": round(percentile(high, 0.99), 4),
        "low_ttft_p99_s": round(percentile([t.ttft_s for t in low], 0.99), 4),
        "low_finished": sum(t.finished_s is not None for t in low),
        "low_requests": len(low),
        "low_longest_wait_s": round(max(t.ttft_s for t in low), 3),
        "output_tokens_per_s_each_run": [round(rate, 1) for rate in rates],
        "output_tokens_per_s": round(sum(rates) / len(rates), 1),
        "output_tokens_per_cpu_s_each_run": [
            round(sum(t.num_output_tokens for t in run.requests) / cpu, 1)
            for run, cpu in zip(runs, cpu_seconds)],
        "schedule_cpu_ms_per_step_each_run": [
            round(1e3 * seconds / len(run.steps), 3)
            for run, seconds in zip(runs, schedule_seconds)],
        "schedule_share_of_cpu_each_run": [
            round(seconds / cpu, 4) for seconds, cpu in zip(schedule_seconds, cpu_seconds)],
        "steps_each_run": [len(run.steps) for run in runs],
        "preemptions_each_run": [sum(len(r.preempted) for r in run.records) for run in runs],
    }


def cost(fcfs_rates: list[float], priority_rates: list[float]) -> dict:
    """1 - priority's rate over fcfs's: of the means, and the median of the alternations'
    pairs."""
    return {"of_means": round(1 - statistics.mean(priority_rates) / statistics.mean(fcfs_rates), 4),
            "median_of_pairs": round(1 - statistics.median(
                p / f for f, p in zip(fcfs_rates, priority_rates)), 4)}


def aging_check(run: RunResult, priorities: dict[str, int], aging_steps: int) -> dict:
    """Every time a later-arriving request started before an earlier one of lower priority
    (a larger value), how many steps later it had arrived, against the documented bound."""
    arrived, started = arrival_steps(run), first_scheduled_steps(run)
    overtakes = [arrived[late] - arrived[early]
                 for early in arrived for late in arrived
                 if arrived[late] > arrived[early] and started[late] < started[early]
                 and priorities[late] < priorities[early]]
    worst_allowed = aging_steps * (LOW - HIGH)
    longest_wait = max(started[r] - arrived[r] for r in arrived if priorities[r] == LOW)
    return {"priority_aging_steps": aging_steps, "overtakes": len(overtakes),
            "longest_overtake_steps": max(overtakes, default=0),
            "bound_steps": worst_allowed,
            "within_bound": max(overtakes, default=0) <= worst_allowed,
            "low_longest_wait_steps": longest_wait}


def preemption_causes(run: RunResult) -> dict:
    causes = [cause for record in run.records for cause in record.preemptions]
    complete = sum(bool(victim and reason and taker) for victim, reason, taker, *_ in causes)
    by_reason: dict[str, int] = {}
    for _, reason, *_ in causes:
        by_reason[reason] = by_reason.get(reason, 0) + 1
    return {"preemptions": len(causes),
            "preempted_listed": sum(len(r.preempted) for r in run.records),
            "with_reason_victim_taker": complete,
            "share": round(complete / len(causes), 4) if causes else None,
            "by_reason": by_reason,
            "blocks_freed": sum(cause[3] for cause in causes),
            "tokens_lost": sum(cause[4] for cause in causes)}


def main(argv=None) -> None:
    args = parse_args(argv)
    max_model_len = args.prompt_tokens[1] + args.output_tokens[1]
    model = save_random_llama(Path(tempfile.mkdtemp(prefix="kvscope-priority-")),
                              vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                              num_layers=2, num_heads=4, num_kv_heads=2,
                              max_positions=max_model_len)
    workload = trace(args)
    priorities = {r.request_id: r.priority for r in workload.requests}
    session = ReplaySession(workload, EngineConfig(
        model=str(model), dtype="float32", device="cpu", block_size=args.block_size,
        num_gpu_blocks_override=args.num_blocks, max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs, priority_aging_steps=args.aging_steps))
    session.run({"scheduling_policy": "priority"})  # warm-up: the first run pays start-up
    runs: dict[str, list[RunResult]] = {"fcfs": [], "priority": []}
    cpu_seconds: dict[str, list[float]] = {"fcfs": [], "priority": []}
    schedule_seconds: dict[str, list[float]] = {"fcfs": [], "priority": []}
    for _ in range(args.repeats):  # alternated, so a burst of load elsewhere hits both
        for policy in runs:
            run, cpu, scheduling = timed_run(session, policy)
            runs[policy].append(run)
            cpu_seconds[policy].append(cpu)
            schedule_seconds[policy].append(scheduling)
    fcfs, prio = (summary(runs[p], cpu_seconds[p], schedule_seconds[p], priorities)
                  for p in ("fcfs", "priority"))
    print(json.dumps({
        # The run's own load, so a reader can tell a quiet machine's numbers from a busy one's.
        "cpu": cpu_name(), "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "model": "random Llama (hidden 64, 2 layers, 1k vocab), float32, live engine",
        "requests": args.requests, "high_share": args.high_share, "rate_per_s": args.rate,
        "block_size": args.block_size, "num_blocks": args.num_blocks,
        "max_num_seqs": args.max_num_seqs,
        "fcfs": fcfs, "priority": prio,
        "high_ttft_p99_fcfs_over_priority": round(
            fcfs["high_ttft_p99_s"] / prio["high_ttft_p99_s"], 2),
        **{f"throughput_cost{suffix}": cost(fcfs[field], prio[field])
           for suffix, field in (("", "output_tokens_per_s_each_run"),
                                 ("_cpu", "output_tokens_per_cpu_s_each_run"))},
        "aging": aging_check(runs["priority"][0], priorities, args.aging_steps),
        "preemption_causes": preemption_causes(runs["priority"][0]),
    }, indent=2))


if __name__ == "__main__":
    main()
