"""GPU check: kernel tests run natively, paged attention timed against SDPA, engine throughput.

One prepared script for a machine with a CUDA GPU. Each section prints one JSON line as it
finishes and a summary line comes last; the whole run stays within --time-budget seconds
(default 480). `--dry-run` runs every section on tiny shapes on whatever device there is
(the CPU here), so the script itself can be checked without a GPU.

    python bench/gpu_check.py                 # on the GPU machine
    python bench/gpu_check.py --dry-run       # anywhere, about a minute
    python bench/gpu_check.py --dry-run --backend triton --sections attention  # interpreted
"""

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvscope import kernels  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent

logger = logging.getLogger("gpu_check")


class Deadline:
    """The time left of the overall budget."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


# --- environment --------------------------------------------------------------------------


def describe_environment(device: torch.device) -> dict:
    record = {
        "section": "environment",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "device": str(device),
        "attention_backend": kernels.backend_name(device),
    }
    try:
        import triton

        record["triton"] = triton.__version__
    except ImportError:
        record["triton"] = None
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        record.update(
            gpu=properties.name,
            gpu_memory_gib=round(properties.total_memory / 2**30, 1),
            multiprocessors=properties.multi_processor_count,
            compute_capability=f"{properties.major}.{properties.minor}",
            cuda=torch.version.cuda,
        )
    return record


# --- 1. the kernel tests, natively --------------------------------------------------------


def run_kernel_tests(deadline: Deadline, dry_run: bool, cap_s: float) -> dict:
    """pytest tests/test_kernels.py; with CUDA the Triton tests run on CUDA tensors."""
    timeout = max(10.0, min(cap_s, deadline.left() - 30))
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "tests/test_kernels.py", "-q",
                   "-p", "no:cacheprovider", f"--junitxml={report}"]
        if dry_run:  # a quick subset: the point is to check this script
            command += ["-k", "reference_store or backend_env"]
        env = {key: value for key, value in os.environ.items()
               if key != kernels.BACKEND_ENV}
        started = time.monotonic()
        try:
            result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True,
                                    text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as expired:
            return {"section": "kernel_tests", "ok": False, "timed_out_after_s": timeout,
                    "output_tail": _tail(expired.stdout)}
        record = {"section": "kernel_tests", "ok": result.returncode == 0,
                  "returncode": result.returncode,
                  "wall_s": round(time.monotonic() - started, 1)}
        if report.exists():
            record.update(_summarize_junit(report))
        if result.returncode != 0:
            record["output_tail"] = _tail(result.stdout + result.stderr)
        return record


def _summarize_junit(report: Path) -> dict:
    root = ElementTree.parse(report).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in suite.iter("testcase"):
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            failed.append({"test": case.get("name"),
                           "message": (problem.get("message") or "")[:300]})
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"]
            - counts["skipped"], "failed_tests": failed[:20]}


def _tail(text: str | bytes | None, limit: int = 3000) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text[-limit:]


# --- 2. paged attention against SDPA on contiguous K/V ------------------------------------


@dataclass(slots=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


def time_call(fn: Callable[[], object], device: torch.device, budget_s: float = 0.3,
              max_iters: int = 200) -> float:
    """Milliseconds per call: two warm-up calls (the first compiles), then a timed loop."""
    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    synchronize()
    started = time.perf_counter()
    fn()
    synchronize()
    once = time.perf_counter() - started
    iters = max(3, min(max_iters, int(budget_s / max(once, 1e-6))))
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        synchronize()
        return start.elapsed_time(end) / iters
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - started) * 1e3 / iters


def build_case(batch: int, seq_len: int, query_len: int, shape: AttentionShape,
               device: torch.device) -> dict:
    """Paged K/V over shuffled physical blocks, and the same K/V laid out contiguously."""
    blocks_per_seq = math.ceil(seq_len / shape.block_size)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(cache_shape, device=device, dtype=shape.dtype)
    value_cache = torch.randn(cache_shape, device=device, dtype=shape.dtype)
    block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq)

    def contiguous(cache: torch.Tensor) -> torch.Tensor:  # [batch, kv_heads, seq_len, dim]
        rows = cache[block_tables].flatten(1, 2)[:, :seq_len]
        return rows.transpose(1, 2).contiguous()

    query = torch.randn(batch * query_len, shape.num_heads, shape.head_dim, device=device,
                        dtype=shape.dtype)
    return {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": block_tables.to(torch.int32),
        "seq_lens": torch.full((batch,), seq_len, dtype=torch.int32, device=device),
        "query_start_loc": (torch.arange(batch + 1, device=device) * query_len).to(torch.int32),
        "keys": contiguous(key_cache),
        "values": contiguous(value_cache),
    }


def bench_one(batch: int, seq_len: int, query_len: int, shape: AttentionShape,
              device: torch.device) -> dict:
    case = build_case(batch, seq_len, query_len, shape, device)
    scale = shape.head_dim ** -0.5
    out = torch.empty_like(case["query"])
    ops = kernels.select_ops(device)

    def paged() -> torch.Tensor:
        return ops.paged_attention(
            case["query"], case["key_cache"], case["value_cache"], case["block_tables"],
            case["seq_lens"], case["query_start_loc"], scale, out=out)

    # SDPA sees [batch, heads, query_len, dim]; the new tokens are the last positions.
    sdpa_query = case["query"].view(batch, query_len, shape.num_heads, shape.head_dim)
    sdpa_query = sdpa_query.transpose(1, 2)
    mask, causal = None, query_len > 1
    if 1 < query_len < seq_len:  # a chunk over cached context: an explicit causal mask
        positions = torch.arange(seq_len, device=device)
        mask = positions[None, :] <= positions[seq_len - query_len:, None]
        causal = False

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            sdpa_query, case["keys"], case["values"], attn_mask=mask, is_causal=causal,
            scale=scale, enable_gqa=shape.num_heads != shape.num_kv_heads)

    paged_ms = time_call(paged, device)
    sdpa_ms = time_call(sdpa, device)
    expected = sdpa().transpose(1, 2).reshape_as(out)
    max_abs_diff = (paged().float() - expected.float()).abs().max().item()

    element = torch.finfo(shape.dtype).bits // 8
    kv_bytes = 2 * batch * seq_len * shape.num_kv_heads * shape.head_dim * element
    io_bytes = kv_bytes + 2 * case["query"].numel() * element
    visible_pairs = query_len * (seq_len - query_len) + query_len * (query_len + 1) // 2
    flops = 4 * batch * shape.num_heads * shape.head_dim * visible_pairs
    record = {
        "batch": batch, "seq_len": seq_len, "query_len": query_len,
        "paged_ms": round(paged_ms, 4), "sdpa_ms": round(sdpa_ms, 4),
        "paged_vs_sdpa_speed": round(sdpa_ms / paged_ms, 3),
        "max_abs_diff": max_abs_diff,
    }
    if query_len == 1:
        record["paged_gb_s"] = round(io_bytes / paged_ms / 1e6, 1)
        record["sdpa_gb_s"] = round(io_bytes / sdpa_ms / 1e6, 1)
        record["kv_mib"] = round(kv_bytes / 2**20, 1)
    else:
        record["paged_tflop_s"] = round(flops / paged_ms / 1e9, 2)
        record["sdpa_tflop_s"] = round(flops / sdpa_ms / 1e9, 2)
    return record


def bench_attention(deadline: Deadline, dry_run: bool, device: torch.device,
                    cap_s: float) -> dict:
    stop_at = time.monotonic() + max(0.0, min(cap_s, deadline.left() - 30))
    if dry_run:
        shape = AttentionShape(4, 2, 64, 16, torch.float32)
        decodes = [(batch, seq_len) for batch in (1, 4) for seq_len in (64, 256)]
        prefills = [(1, 64, 64), (2, 128, 128), (1, 192, 32)]
    else:
        # A Llama-8B-like layer: 32 query heads over 8 kv heads, head_dim 128, bf16.
        shape = AttentionShape(32, 8, 128, 16, torch.bfloat16)
        decodes = [(batch, seq_len) for seq_len in (512, 2048, 8192)
                   for batch in (1, 8, 32, 64, 128, 256)]
        prefills = [(1, 512, 512), (1, 2048, 2048), (4, 2048, 2048), (1, 8192, 8192),
                    (1, 4608, 512)]  # the last: a 512-token chunk over 4096 cached tokens
    record = {
        "section": "attention",
        "backend": kernels.backend_name(device),
        "num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim, "block_size": shape.block_size,
        "dtype": str(shape.dtype).removeprefix("torch."),
        "sdpa": "scaled_dot_product_attention(enable_gqa) on contiguous [batch, kv_heads, "
                "seq_len, head_dim] copies of the same K/V",
        "decode": [], "prefill": [], "skipped_for_time": [],
    }
    for kind, configs in (("decode", [(b, s, 1) for b, s in decodes]), ("prefill", prefills)):
        for batch, seq_len, query_len in configs:
            name = f"{kind} batch={batch} seq_len={seq_len} query_len={query_len}"
            if time.monotonic() > stop_at:
                record["skipped_for_time"].append(name)
                continue
            logger.info("timing %s", name)
            try:
                record[kind].append(bench_one(batch, seq_len, query_len, shape, device))
            except Exception as error:  # one failing shape (e.g. out of memory) is a result
                logger.exception("%s failed", name)
                record[kind].append({"batch": batch, "seq_len": seq_len,
                                     "query_len": query_len, "error": repr(error)[:300]})
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return record


# --- 3. engine throughput -----------------------------------------------------------------


def run_throughput(deadline: Deadline, dry_run: bool, device: torch.device) -> dict:
    script = REPO_ROOT / "bench" / "throughput.py"
    command = [sys.executable, str(script.relative_to(REPO_ROOT)), "--device", device.type]
    record: dict = {"section": "throughput", "command": " ".join(command[1:])}
    if not script.exists():
        return {**record, "skipped": "bench/throughput.py does not exist yet"}
    if dry_run:
        return {**record, "skipped": "dry run"}
    timeout = deadline.left() - 5
    if timeout < 30:
        return {**record, "skipped": f"only {timeout:.0f} s of the time budget left"}
    started = time.monotonic()
    try:
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                                timeout=timeout, check=False)
    except subprocess.TimeoutExpired as expired:
        return {**record, "ok": False, "timed_out_after_s": round(timeout),
                "output_tail": _tail(expired.stdout)}
    record.update(ok=result.returncode == 0, returncode=result.returncode,
                  wall_s=round(time.monotonic() - started, 1))
    parsed = _parse_json_output(result.stdout)
    if parsed is not None:
        record["result"] = parsed
    else:
        record["stdout_tail"] = _tail(result.stdout)
    if result.returncode != 0:
        record["stderr_tail"] = _tail(result.stderr)
    return record


def _parse_json_output(stdout: str):
    """The whole stdout as JSON, else its JSON lines (one object, or a list of them)."""
    try:
        return json.loads(stdout)
    except json.JSONDecodeError:
        pass
    objects = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith(("{", "[")):
            try:
                objects.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    if not objects:
        return None
    return objects[0] if len(objects) == 1 else objects


# --- main ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on any device (checks this script)")
    parser.add_argument("--device", default=None,
                        help="default: cuda when available, else cpu")
    parser.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto",
                        help="attention backend to time (auto: triton on CUDA); triton on "
                             "the CPU runs interpreted")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for the whole run (default 480, dry run 240)")
    parser.add_argument("--sections", default="tests,attention,throughput",
                        help="comma-separated subset of tests,attention,throughput")
    parser.add_argument("--output", type=Path, default=None,
                        help="also write every record to this JSON file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.dry_run:
        parser.error(f"--device {device} is not a CUDA device; use --dry-run off the GPU")
    if args.backend != "auto":
        os.environ[kernels.BACKEND_ENV] = args.backend
        if args.backend == "triton" and device.type != "cuda":
            os.environ["TRITON_INTERPRET"] = "1"  # before the kernels import triton
    budget = args.time_budget or (240.0 if args.dry_run else 480.0)
    deadline = Deadline(budget)
    sections = {name.strip() for name in args.sections.split(",") if name.strip()}
    unknown = sections - {"tests", "attention", "throughput"}
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}")

    records = [describe_environment(device)]
    emit(records[0])
    steps = [
        ("tests", lambda: run_kernel_tests(deadline, args.dry_run, cap_s=0.45 * budget)),
        ("attention", lambda: bench_attention(deadline, args.dry_run, device,
                                              cap_s=0.3 * budget)),
        ("throughput", lambda: run_throughput(deadline, args.dry_run, device)),
    ]
    for name, step in steps:
        if name not in sections:
            continue
        started = time.monotonic()
        try:
            record = step()
        except Exception as error:  # a broken section must not hide the others' numbers
            logger.exception("section %s failed", name)
            record = {"section": name, "ok": False, "error": repr(error)[:500]}
        record["section_s"] = round(time.monotonic() - started, 1)
        records.append(record)
        emit(record)

    failed = [r["section"] for r in records if r.get("ok") is False]
    summary = {"section": "summary", "ok": not failed, "failed_sections": failed,
               "dry_run": args.dry_run, "wall_s": round(budget - deadline.left(), 1),
               "time_budget_s": budget}
    records.append(summary)
    emit(summary)
    if args.output is not None:
        args.output.write_text(json.dumps(records, indent=2))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
