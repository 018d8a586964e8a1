"""Device memory: what a profiling forward peaks at, and how many KV blocks fit."""

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)
GiB = 1 << 30


@dataclass(slots=True)
class MemoryPlan:
    """The budget arithmetic, kept so the dashboard and logs can show it."""

    device_memory_bytes: int
    gpu_memory_utilization: float
    weight_bytes: int
    peak_activation_bytes: int
    bytes_per_block: int
    block_size: int
    num_blocks: int
    max_model_len: int
    # every layer's window, when they share one: a sequence then holds at most
    # ceil(W / block_size) + 1 blocks while it decodes (the KV manager frees the rest)
    sliding_window: int | None = None
    # weight_bytes per storage type: GGUF block types (Q4_K, Q6_K...) and dtypes
    weight_bytes_by_type: dict[str, int] = field(default_factory=dict)

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many max_model_len sequences the pool holds at once (decoding at their
        last token)."""
        return self.num_blocks / self.blocks_per_max_len_seq

    @property
    def blocks_per_max_len_seq(self) -> int:
        blocks = -(-self.max_model_len // self.block_size)
        if self.sliding_window is None:
            return blocks
        return min(blocks, -(-self.sliding_window // self.block_size) + 1)

    @property
    def full_attention_concurrency(self) -> float:
        """max_concurrency had every layer attended to the whole sequence."""
        return self.num_blocks / -(-self.max_model_len // self.block_size)

    def weights_by_type(self) -> str:
        """"Q4_K 61.2, Q6_K 20.4, float32 0.1 MiB", largest first ("" when unknown)."""
        largest = sorted(self.weight_bytes_by_type.items(), key=lambda item: -item[1])
        return ", ".join(f"{name} {size / (1 << 20):.1f}" for name, size in largest) + (
            " MiB" if largest else "")

    def describe(self) -> str:
        by_type = self.weights_by_type()
        return (f"weights {self.weight_bytes / (1 << 20):.1f} MiB"
                + (f" ({by_type})" if by_type else "") + "; "
                f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.num_tokens} tokens, {self.kv_cache_bytes / GiB:.3f} GiB "
                f"({self.bytes_per_block} bytes/block); max concurrency at "
                f"max_model_len={self.max_model_len}: {self.max_concurrency:.2f}x"
                + (f" (sliding window {self.sliding_window}; full attention "
                   f"{self.full_attention_concurrency:.2f}x)" if self.sliding_window else ""))


class PoolTooSmall(ValueError):
    """The pool cannot hold one max_model_len sequence; the numbers let each caller name
    the knobs its user can turn."""

    def __init__(self, message: str, plan: "MemoryPlan") -> None:
        super().__init__(message)
        self.plan = plan


def plan_blocks(
    device_memory_bytes: int,
    gpu_memory_utilization: float,
    weight_bytes: int,
    peak_activation_bytes: int,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    num_blocks_override: int | None = None,
    sliding_window: int | None = None,
    weight_bytes_by_type: dict[str, int] | None = None,
) -> MemoryPlan:
    """vLLM's budget: (memory x utilization - weights - peak activations) // bytes per block.

    Fails if the pool cannot hold one max_model_len sequence, saying what fits and which
    knob to turn.
    """
    budget = int(device_memory_bytes * gpu_memory_utilization) - weight_bytes - peak_activation_bytes
    num_blocks = num_blocks_override or max(budget // bytes_per_block, 0)
    plan = MemoryPlan(device_memory_bytes, gpu_memory_utilization, weight_bytes,
                      peak_activation_bytes, bytes_per_block, block_size, num_blocks, max_model_len,
                      sliding_window, dict(weight_bytes_by_type or {}))
    if plan.num_tokens < max_model_len:
        raise PoolTooSmall(
            f"the KV cache holds {plan.num_tokens} tokens ({num_blocks} blocks of {block_size}; "
            f"{device_memory_bytes / GiB:.2f} GiB x gpu_memory_utilization={gpu_memory_utilization}"
            f" - weights {weight_bytes / GiB:.3f} GiB - activations "
            f"{peak_activation_bytes / GiB:.3f} GiB) but max_model_len={max_model_len} needs "
            f"{max_model_len}: raise gpu_memory_utilization or device_memory_gb, or lower "
            "max_model_len or max_num_batched_tokens", plan)
    return plan


def measure_peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated while `fn` runs, above what was allocated before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    # The CPU allocator keeps no statistics, but the profiler records every allocation
    # with the running total of bytes allocated since profiling began.
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with _without_profiler_banner(), profile(activities=[ProfilerActivity.CPU],
                                             profile_memory=True) as prof:
        fn()
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    peak = 0
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation:
            peak = max(peak, event.extra_fields.total_allocated)
    return peak


@contextlib.contextmanager
def _without_profiler_banner():
    """Kineto writes "USDT: profiler_start/stop" lines straight to file descriptor 2 and
    no setting turns them off; catch fd 2 meanwhile and pass on every other line."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines(True)
                    if not line.startswith("USDT:")]
            if kept:
                sys.stderr.write("".join(kept))


def device_memory_bytes(device: torch.device, configured_gb: float) -> int:
    """Total memory of the CUDA device, or the configured size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return int(configured_gb * GiB)
