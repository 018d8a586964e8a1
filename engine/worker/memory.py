"""Device memory: what a profiling forward peaks at, and how many KV blocks fit."""

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvscope.engine.core.kv_groups import KVCacheGroup
from kvscope.kernels import kv_quant

logger = logging.getLogger(__name__)
GiB = 1 << 30
# The groups of a plan made without the model's layers: full attention, one block table.
ONE_FULL_GROUP = (KVCacheGroup(None, (0,)),)


@dataclass(slots=True)
class MemoryPlan:
    """The budget arithmetic, kept so the dashboard and logs can show it."""

    device_memory_bytes: int
    gpu_memory_utilization: float
    weight_bytes: int
    peak_activation_bytes: int
    bytes_per_block: int  # K and V of block_size tokens in layers_per_block layers
    block_size: int
    num_blocks: int
    max_model_len: int
    # The KV cache groups sharing the pool (engine.core.kv_groups).
    groups: tuple[KVCacheGroup, ...] = ONE_FULL_GROUP
    # A draft model's share (speculative decoding), included in weight_bytes and
    # bytes_per_block: its KV pool has a block for each of the target's.
    draft_weight_bytes: int = 0
    draft_bytes_per_block: int = 0
    # the target's weight_bytes per storage type: GGUF block types (Q4_K, Q6_K...) and dtypes
    weight_bytes_by_type: dict[str, int] = field(default_factory=dict)
    kv_cache_dtype: str = "auto"
    # what the same budget gives a cache in the model's dtype (the figures the log and the
    # dashboard compare against); equal to the above with kv_cache_dtype auto
    auto_bytes_per_block: int = 0
    auto_num_blocks: int = 0
    # A model with recurrent layers: one state slot per running sequence (every recurrent
    # layer's state, engine.core.state_slots), taken out of the same budget as the blocks.
    # num_state_slots is how many sequences can run at once: max_num_seqs (the asked-for
    # count) capped by what the budget leaves beside one max_model_len sequence's blocks.
    bytes_per_state_slot: int = 0
    num_state_slots: int = 0
    max_num_seqs: int = 0
    num_state_layers: int = 0  # the recurrent layers (not in any KV cache group)

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def state_slot_bytes(self) -> int:
        return self.num_state_slots * self.bytes_per_state_slot

    def describe_state_slots(self) -> str:
        """The state slots and the sequences they allow ("" without recurrent layers)."""
        if not self.bytes_per_state_slot:
            return ""
        capped = (f" (max_num_seqs={self.max_num_seqs} capped: the slots allow "
                  f"{self.num_state_slots} running sequences)"
                  if self.num_state_slots < self.max_num_seqs else "")
        return (f"; state slots: {self.num_state_slots} x {self.bytes_per_state_slot} bytes = "
                f"{self.state_slot_bytes / GiB:.3f} GiB, one per running sequence{capped}")

    @property
    def full_attention_bytes_per_block(self) -> int:
        """bytes_per_block had the recurrent layers been full-attention layers shaped like
        the model's attention layers (every layer then holds a block per position)."""
        layers_per_block = max(len(group.layers) for group in self.groups)
        num_layers = sum(len(group.layers) for group in self.groups) + self.num_state_layers
        return self.bytes_per_block * num_layers // layers_per_block

    def sequence_bytes(self) -> int:
        """One max_model_len sequence's share of the pool: its blocks in every group and
        its state slot."""
        return self.blocks_per_max_len_seq * self.bytes_per_block + self.bytes_per_state_slot

    def describe_full_attention(self) -> str:
        """What the same model with every layer full attention needs for the sequences
        the state slots allow ("" without recurrent layers)."""
        if not self.bytes_per_state_slot:
            return ""
        sequences = self.num_state_slots
        full = (sequences * -(-self.max_model_len // self.block_size)
                * self.full_attention_bytes_per_block)
        here = sequences * self.sequence_bytes()
        return (f"{sequences} sequences of max_model_len={self.max_model_len} tokens need "
                f"{here / 2**20:.1f} MiB here (blocks and slots); with every layer full "
                f"attention ({self.full_attention_bytes_per_block} bytes/block) they would "
                f"need {full / 2**20:.1f} MiB ({full / max(here, 1):.2f}x)")

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        return tuple(group.window for group in self.groups)

    @property
    def max_concurrency(self) -> float:
        """How many max_model_len sequences the pool holds at once (decoding at their
        last token, each sliding group holding only its window's blocks)."""
        return self.num_blocks / self.blocks_per_max_len_seq

    def group_blocks_per_max_len_seq(self) -> list[int]:
        """Each group's blocks for one max_model_len sequence decoding its last token: all
        of them under full attention, ceil(W / block_size) + 1 in a sliding window W."""
        blocks = -(-self.max_model_len // self.block_size)
        return [blocks if window is None else min(blocks, -(-window // self.block_size) + 1)
                for window in self.group_windows]

    @property
    def blocks_per_max_len_seq(self) -> int:
        return sum(self.group_blocks_per_max_len_seq())

    @property
    def full_attention_concurrency(self) -> float:
        """max_concurrency had every layer attended to the whole sequence: the same bytes,
        every layer holding a block per position."""
        layers_per_block = max(len(group.layers) for group in self.groups)
        num_layers = sum(len(group.layers) for group in self.groups)
        blocks = -(-self.max_model_len // self.block_size)
        return self.num_blocks * layers_per_block / (num_layers * blocks)

    def weights_by_type(self) -> str:
        """"Q4_K 61.2, Q6_K 20.4, float32 0.1 MiB", largest first ("" when unknown)."""
        largest = sorted(self.weight_bytes_by_type.items(), key=lambda item: -item[1])
        return ", ".join(f"{name} {size / (1 << 20):.1f}" for name, size in largest) + (
            " MiB" if largest else "")

    def describe_kv_dtype(self) -> str:
        """kv_cache_dtype, bytes per block and the blocks it gains over auto."""
        if self.kv_cache_dtype == "auto":
            return f"kv_cache_dtype auto, {self.bytes_per_block} bytes/block"
        return (f"kv_cache_dtype {self.kv_cache_dtype}, {self.bytes_per_block} bytes/block "
                f"(auto: {self.auto_bytes_per_block}): {self.num_blocks - self.auto_num_blocks:+d} "
                f"blocks over auto's {self.auto_num_blocks} "
                f"({self.num_blocks / max(self.auto_num_blocks, 1):.2f}x)")

    def describe(self) -> str:
        by_type = self.weights_by_type()
        text = (f"weights {self.weight_bytes / (1 << 20):.1f} MiB"
                + (f" ({by_type})" if by_type else "") + "; "
                f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.num_tokens} tokens, {self.kv_cache_bytes / GiB:.3f} GiB "
                f"({self.describe_kv_dtype()}); max concurrency at "
                f"max_model_len={self.max_model_len}: {self.max_concurrency:.2f}x"
                + self.describe_state_slots())
        if self.draft_weight_bytes:
            text += (f"; of these the draft model's: weights "
                     f"{self.draft_weight_bytes / (1 << 20):.1f} MiB, KV "
                     f"{self.draft_bytes_per_block} bytes/block "
                     f"({self.num_blocks * self.draft_bytes_per_block / GiB:.3f} GiB)")
        if all(window is None for window in self.group_windows):
            return text
        per_group = ", ".join(
            f"{'full' if group.window is None else f'window {group.window}'} "
            f"({len(group.layers)} layers) {blocks * self.bytes_per_block / (1 << 20):.1f} MiB"
            for group, blocks in zip(self.groups, self.group_blocks_per_max_len_seq()))
        return (f"{text} (a max_model_len sequence holds, per KV cache group: {per_group}; "
                f"full attention {self.full_attention_concurrency:.2f}x)")


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
    groups: tuple[KVCacheGroup, ...] | None = None,
    draft_weight_bytes: int = 0,
    draft_bytes_per_block: int = 0,
    weight_bytes_by_type: dict[str, int] | None = None,
    *,
    kv_cache_dtype: str = "auto",
    auto_bytes_per_block: int | None = None,
    bytes_per_state_slot: int = 0,
    max_num_seqs: int = 1,
    num_state_layers: int = 0,
) -> MemoryPlan:
    """vLLM's budget: (memory x utilization - weights - peak activations) // bytes per block.

    Fails if the pool cannot hold one max_model_len sequence in every KV cache group (its
    prompt before any block leaves a window), saying what fits and which knob to turn. A
    draft model's weights and per-block KV are already in weight_bytes and
    bytes_per_block; its shares are kept for the plan's description. auto_bytes_per_block:
    a block's bytes in the model's dtype, for the comparison a quantized kv_cache_dtype's
    plan keeps (default: bytes_per_block).

    bytes_per_state_slot > 0 (a model with recurrent layers): state slots come out of the
    budget first, max_num_seqs of them or as many as fit beside one max_model_len
    sequence's blocks (at least one, else PoolTooSmall with the numbers); the blocks get
    the rest. With num_blocks_override the slots are max_num_seqs, as the blocks ignore
    the budget. num_state_layers: how many layers keep a state slot's share, kept for
    the full-attention comparison (MemoryPlan.describe_full_attention).
    """
    budget = int(device_memory_bytes * gpu_memory_utilization) - weight_bytes - peak_activation_bytes
    groups = groups or ONE_FULL_GROUP
    num_slots = 0
    if bytes_per_state_slot:
        one_sequence = -(-max_model_len // block_size) * len(groups) * bytes_per_block
        num_slots = max_num_seqs if num_blocks_override else min(
            max_num_seqs, max(budget - one_sequence, 0) // bytes_per_state_slot)
        if num_slots < 1:
            raise PoolTooSmall(
                f"one sequence needs {one_sequence} bytes of KV blocks (max_model_len="
                f"{max_model_len}) plus a {bytes_per_state_slot}-byte state slot for its "
                f"recurrent layers, but the budget holds {max(budget, 0)} bytes "
                f"({device_memory_bytes / GiB:.2f} GiB x gpu_memory_utilization="
                f"{gpu_memory_utilization} - weights {weight_bytes / GiB:.3f} GiB - "
                f"activations {peak_activation_bytes / GiB:.3f} GiB): raise "
                "gpu_memory_utilization or device_memory_gb, or lower max_model_len",
                MemoryPlan(device_memory_bytes, gpu_memory_utilization, weight_bytes,
                           peak_activation_bytes, bytes_per_block, block_size, 0,
                           max_model_len, groups, bytes_per_state_slot=bytes_per_state_slot,
                           max_num_seqs=max_num_seqs, num_state_layers=num_state_layers))
        budget -= num_slots * bytes_per_state_slot
    num_blocks = num_blocks_override or max(budget // bytes_per_block, 0)
    auto_bytes_per_block = auto_bytes_per_block or bytes_per_block
    plan = MemoryPlan(device_memory_bytes, gpu_memory_utilization, weight_bytes,
                      peak_activation_bytes, bytes_per_block, block_size, num_blocks, max_model_len,
                      groups, draft_weight_bytes, draft_bytes_per_block,
                      dict(weight_bytes_by_type or {}), kv_cache_dtype, auto_bytes_per_block,
                      num_blocks_override or max(budget // auto_bytes_per_block, 0),
                      bytes_per_state_slot, num_slots, max_num_seqs, num_state_layers)
    num_tokens = num_blocks // len(plan.groups) * block_size
    if num_tokens < max_model_len:
        in_groups = f" in {len(plan.groups)} KV cache groups" if len(plan.groups) > 1 else ""
        if num_blocks_override:  # the memory knobs play no part in an overridden pool
            needed = -(-max_model_len // block_size) * len(plan.groups)
            raise PoolTooSmall(
                f"num_gpu_blocks_override={num_blocks_override} blocks of {block_size}"
                f"{in_groups} hold {num_tokens} tokens but max_model_len={max_model_len} "
                f"needs {max_model_len}: raise num_gpu_blocks_override to at least {needed}, "
                "or lower max_model_len", plan)
        raise PoolTooSmall(
            f"the KV cache holds {num_tokens} tokens ({num_blocks} blocks of {block_size}"
            f"{in_groups}; {device_memory_bytes / GiB:.2f} GiB x "
            f"gpu_memory_utilization={gpu_memory_utilization}"
            f" - weights {weight_bytes / GiB:.3f} GiB - activations "
            f"{peak_activation_bytes / GiB:.3f} GiB) but max_model_len={max_model_len} needs "
            f"{max_model_len}: raise gpu_memory_utilization or device_memory_gb, or lower "
            "max_model_len or max_num_batched_tokens", plan)
    return plan


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       model_dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """K and V for block_size tokens in num_layers layers (a KV cache group's), scales
    included (kernels/kv_quant.py)."""
    dtype = kv_quant.cache_dtype(kv_cache_dtype, model_dtype)
    return (2 * num_layers * block_size * num_kv_heads * kv_quant.row_width(head_dim, dtype)
            * dtype.itemsize)


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
    # with the running total of bytes its reporter counts. That total is process-wide and
    # keeps what earlier profiling sessions allocated and freed outside one (a reporter
    # forgets only frees it sees), so it is read relative to its level before fn's first
    # allocation: otherwise each profile in a process (every reconfigure's) read higher.
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with _without_profiler_banner(), profile(activities=[ProfilerActivity.CPU],
                                             profile_memory=True) as prof:
        fn()
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    allocations = []
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.extra_fields.alloc_size,
                                event.extra_fields.total_allocated))
    if not allocations:
        return 0
    allocations.sort()
    _, first_size, first_total = allocations[0]
    before = first_total - first_size
    return max(0, max(total for _, _, total in allocations) - before)


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
