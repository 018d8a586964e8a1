"""A step's StepRecord, built from what the step decided and the engine's state after it.

Telemetry sits below the orchestrator: it names what it reads of an engine as a protocol
(RecordedEngine; orchestrator.EngineCore is one), and the orchestrator hands it the step.
"""

import time
from typing import Protocol

import torch

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.kv_cache_manager import KVCacheManager
from kvscope.engine.core.kv_events import EventBus
from kvscope.engine.core.kv_offload.tier import KVTier
from kvscope.engine.core.request import Request, Sequence
from kvscope.engine.core.scheduler import Scheduler
from kvscope.engine.core.scheduler_output import SchedulerOutput
from kvscope.engine.spec_decode.metrics import SpecDraft
from kvscope.engine.telemetry.experts import expert_bytes, packed_counts
from kvscope.engine.telemetry.records import StepRecord
from kvscope.engine.worker.models.moe import ExpertLayout


class RecordedEngine(Protocol):
    """What telemetry reads of an engine: its config, event bus, pool and queues, a
    mixture-of-experts model's experts (None for a dense model) and its disk tier (None
    without one)."""

    config: EngineConfig
    expert_layout: ExpertLayout | None
    events: EventBus
    kv_cache: KVCacheManager
    kv_tier: KVTier | None
    scheduler: Scheduler
    step_index: int

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def live_sequences(self) -> list[Sequence]: ...

    def holding_sequences(self) -> list[Sequence]: ...


def record_step(engine: RecordedEngine, plan: SchedulerOutput, start_time: float,
                finished: list[Request], num_generated: int,
                drafts: tuple[SpecDraft, ...], expert_tokens: torch.Tensor | None = None
                ) -> StepRecord:
    """The record of the engine's step `engine.step_index`. The pool's figures are read now:
    with async scheduling they already hold the blocks of the step launched after it.
    `expert_tokens`: the step's forward's tokens per expert [MoE layers, experts], read
    before the next forward overwrote them (None: no forward ran, or a dense model)."""
    pool = engine.kv_cache.pool
    layout = engine.expert_layout
    routed = layout is not None and expert_tokens is not None
    read, everything = expert_bytes(layout, expert_tokens) if routed else (0, 0)
    queries, hits, blocks_out, blocks_in = plan.stat_deltas
    return StepRecord(
        step=engine.step_index, start_time=start_time, end_time=time.time(),
        chunks=tuple((s.seq.request.request_id, s.seq.seq_id, s.kind.value, s.start, s.end)
                     for s in plan.scheduled),
        preempted=tuple(s.seq_id for s in plan.preempted),
        swapped_out=tuple(s.seq_id for s in plan.swapped_out),
        swapped_in=tuple(s.seq_id for s in plan.swapped_in),
        finished=tuple(r.request_id for r in finished),
        num_scheduled_tokens=plan.num_scheduled_tokens,
        token_budget=engine.config.max_num_batched_tokens,
        num_used_blocks=pool.num_used_blocks, num_cached_blocks=pool.num_cached_free_blocks,
        num_free_blocks=pool.num_free_blocks - pool.num_cached_free_blocks,
        num_running=engine.num_running, num_waiting=engine.num_waiting,
        num_generated_tokens=num_generated, prefix_cache_queries=queries,
        prefix_cache_hits=hits, num_blocks_swapped_out=blocks_out,
        num_blocks_swapped_in=blocks_in, spec_drafts=drafts,
        expert_layers=layout.layers if routed else (),
        expert_tokens=packed_counts(expert_tokens) if routed else (),
        expert_bytes_read=read, expert_bytes_all=everything,
        preemptions=tuple((p.seq.seq_id, p.reason.value, p.taker.seq_id, p.blocks_freed,
                           p.tokens_lost) for p in plan.preemptions),
        prefix_misses=tuple((m.seq.seq_id, m.reason.value, m.num_tokens, m.evicted_by,
                             m.evicted_step) for m in plan.prefix_misses),
        kv_tier=engine.kv_tier.step_counts() if engine.kv_tier is not None else ())
