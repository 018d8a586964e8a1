"""Two checkouts of kvscope on one bench/throughput.py workload, alternated round by round.

A host's memory speed can drift from one minute to the next, so two versions measured
minutes apart compare the drift as much as the code. Here each round runs both versions,
in turn order A B, then B A, and so on, and the ratio is taken within each round; the
report gives every round and the median ratio.

    python bench/ab.py --a ../before --b . --rounds 3 -- --backends kvscope
    python bench/ab.py --a ../before --b . --rounds 3 -- --single-stream --backends kvscope

Each checkout runs its own bench/throughput.py with its own `.venv/bin/python` (what
`make install` made there), from its own folder. Arguments after `--` go to both.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

METRICS = ("output_tokens_per_s", "decode_tokens_per_s")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", type=Path, required=True, help="checkout A (e.g. the baseline)")
    parser.add_argument("--b", type=Path, required=True, help="checkout B (e.g. the change)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("throughput_args", nargs=argparse.REMAINDER,
                        help="after --: arguments for bench/throughput.py")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    for flag in ("a", "b"):
        checkout = getattr(args, flag).resolve()
        if not (checkout / ".venv" / "bin" / "python").exists():
            parser.error(f"--{flag} {checkout}: no .venv/bin/python there (run `make install`)")
        setattr(args, flag, checkout)
    args.throughput_args = [a for a in args.throughput_args if a != "--"]
    return args


def run_once(checkout: Path, throughput_args: list[str]) -> dict:
    """One bench/throughput.py run in `checkout`: kvscope's rate and the whole report."""
    result = subprocess.run(
        [str(checkout / ".venv" / "bin" / "python"), "bench/throughput.py", *throughput_args],
        cwd=checkout, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{checkout}: bench/throughput.py exited {result.returncode}:\n"
                         f"{result.stderr[-2000:]}")
    report = json.loads(result.stdout)
    kvscope = report["results"]["kvscope"]
    metric = next(name for name in METRICS if name in kvscope)
    return {"metric": metric, "value": kvscope[metric]}


def main(argv=None) -> None:
    args = parse_args(argv)
    rounds = []
    for index in range(args.rounds):
        order = ("a", "b") if index % 2 == 0 else ("b", "a")
        values = {side: run_once(getattr(args, side), args.throughput_args) for side in order}
        ratio = values["b"]["value"] / values["a"]["value"]
        rounds.append({"order": "".join(order).upper(), "a": values["a"]["value"],
                       "b": values["b"]["value"], "b_over_a": round(ratio, 3)})
        print(json.dumps(rounds[-1]), file=sys.stderr)
    print(json.dumps({
        "a": str(args.a), "b": str(args.b), "throughput_args": args.throughput_args,
        "metric": values["a"]["metric"], "rounds": rounds,
        "median_b_over_a": round(statistics.median(r["b_over_a"] for r in rounds), 3),
    }, indent=2))


if __name__ == "__main__":
    main()
