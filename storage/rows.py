"""Engine records <-> plain row dicts of the session log tables."""

import dataclasses
import time
from typing import TYPE_CHECKING

import numpy as np

from kvscope.engine.outputs import RequestOutput
from kvscope.engine.replicas.router import RoutingDecision
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.experts import COUNT_DTYPE, step_counts
from kvscope.engine.telemetry.records import TIER_STEP_FIELDS, StepRecord

if TYPE_CHECKING:  # beam search loads torch; a row only needs the params' to_dict()
    from kvscope.engine.orchestrator.beam_search import BeamSearchParams

STEP_COUNTERS = ("step", "start_time", "end_time", "num_scheduled_tokens", "token_budget",
                 "num_used_blocks", "num_cached_blocks", "num_free_blocks", "num_running",
                 "num_waiting", "num_generated_tokens", "prefix_cache_queries",
                 "prefix_cache_hits", "num_blocks_swapped_out", "num_blocks_swapped_in",
                 "replica", "expert_bytes_read", "expert_bytes_all")
STEP_ID_LISTS = ("preempted", "swapped_out", "swapped_in", "finished")
TIER_COLUMNS = tuple(f"tier_{name}" for name in TIER_STEP_FIELDS)  # NULL: no tier


def step_row(session_id: int, record: StepRecord) -> dict:
    row = {name: getattr(record, name) for name in STEP_COUNTERS}
    row.update({name: list(getattr(record, name)) for name in STEP_ID_LISTS})
    row["chunks"] = [list(chunk) for chunk in record.chunks]
    row["spec_drafts"] = [list(draft) for draft in record.spec_drafts]
    row["preemptions"] = [list(cause) for cause in record.preemptions]
    row["prefix_misses"] = [list(cause) for cause in record.prefix_misses]
    row["expert_layers"] = list(record.expert_layers)
    row["expert_tokens"] = step_counts(record).tolist()
    row.update(zip(TIER_COLUMNS, record.kv_tier or (None,) * len(TIER_COLUMNS), strict=True))
    row["session_id"] = session_id
    return row


def step_record(row: dict) -> StepRecord:
    """Rebuild the StepRecord a stored row came from (for redrawing past sessions)."""
    return StepRecord(
        **{name: row[name] for name in STEP_COUNTERS},
        **{name: tuple(row[name]) for name in STEP_ID_LISTS},
        chunks=tuple(tuple(chunk) for chunk in row["chunks"]),
        spec_drafts=tuple(tuple(draft) for draft in row.get("spec_drafts") or ()),
        preemptions=tuple(tuple(cause) for cause in row.get("preemptions") or ()),
        prefix_misses=tuple(tuple(cause) for cause in row.get("prefix_misses") or ()),
        expert_layers=tuple(row.get("expert_layers") or ()),
        expert_tokens=tuple(np.array(tokens, dtype=COUNT_DTYPE).tobytes()
                            for tokens in row.get("expert_tokens") or ()),
        kv_tier=(tuple(row[column] for column in TIER_COLUMNS)
                 if row.get(TIER_COLUMNS[0]) is not None else ()))


def request_row(session_id: int, output: RequestOutput, source: str,
                prompt_text: str | None, replica: int = 0,
                params: "SamplingParams | BeamSearchParams | None" = None,
                session_start: float | None = None
                ) -> dict:
    metrics = output.metrics
    arrival = metrics.arrival_time if metrics else None
    return {
        "session_id": session_id, "request_id": output.request_id, "source": source,
        "prompt": prompt_text if prompt_text is not None else output.prompt,
        "outputs": [completion.text for completion in output.outputs],
        "finish_reason": next((c.finish_reason for c in output.outputs if c.finish_reason),
                              None),
        "num_prompt_tokens": len(output.prompt_token_ids),
        "num_output_tokens": sum(len(c.token_ids) for c in output.outputs),
        "num_cached_tokens": output.num_cached_tokens,
        "num_preemptions": metrics.num_preemptions if metrics else 0,
        "arrival_time": metrics.arrival_time if metrics else None,
        "first_scheduled_time": metrics.first_scheduled_time if metrics else None,
        "first_token_time": metrics.first_token_time if metrics else None,
        "finished_time": (metrics.finished_time if metrics else None) or time.time(),
        "error": output.error,
        "replica": replica,
        "prompt_token_ids": list(output.prompt_token_ids),
        "output_token_ids": [list(c.token_ids) for c in output.outputs],
        "sampling_params": params.to_dict() if params is not None else None,
        "arrival_offset_s": (arrival - session_start
                             if arrival is not None and session_start is not None else None),
    }


def routing_decision_row(session_id: int, decision: RoutingDecision) -> dict:
    return {
        "session_id": session_id, "request_id": decision.request_id, "time": decision.time,
        "policy": decision.policy, "replica": decision.replica,
        "num_prompt_blocks": decision.num_prompt_blocks,
        "matched_blocks": decision.matched_blocks,
        "candidates": [dataclasses.asdict(candidate) for candidate in decision.candidates],
    }
