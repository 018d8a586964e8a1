"""The event log beside the live panels: one line per notable event, in plain words,
newest first, read from the engine's step records (and the pool's eviction counter)."""

from collections.abc import Sequence
from dataclasses import dataclass

from kvscope.engine.telemetry.records import PreemptionCause, PrefixMissCause, StepRecord

MAX_EVENTS = 30
# Decode-only steps have no events: the log looks this far back at most, so a long quiet
# stretch costs a refresh little.
MAX_SCANNED_STEPS = 500
# Each PreemptionReason (engine.core.kv_events) in words.
PREEMPTION_WORDS = {
    "kv_full": "the pool was out of blocks for a running sequence's next tokens",
    "priority": "a higher-priority request needed its blocks to start",
    "max_num_seqs": "a higher-priority request needed its seat (max_num_seqs)"}


@dataclass(frozen=True, slots=True)
class Evictions:
    """Cached blocks the pool evicted between two refreshes, seen by the step after them."""

    step: int
    num_blocks: int


def counted(number: int, noun: str) -> str:
    """"1 block", "2 blocks"."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def preemption_words(cause: PreemptionCause, swapped: set[str]) -> str:
    """Why a sequence was preempted, for whom, and what it cost, in plain words."""
    victim, reason, taker, blocks_freed, tokens_lost = cause
    cost = ("its K/V went to CPU memory" if victim in swapped else
            f"{tokens_lost} computed tokens to compute again")
    return (f"({PREEMPTION_WORDS[reason]}, for "
            f"{'itself: it gave way alone' if taker == victim else taker}): "
            f"{counted(blocks_freed, 'block')} freed, {cost}")


def miss_words(cause: PrefixMissCause) -> str:
    """Why an admission's prefix hit stopped short of tokens the cache had seen, in plain
    words."""
    seq_id, reason, num_tokens, evicted_by, evicted_step = cause
    if reason == "evicted":
        return (f"{seq_id} missed {counted(num_tokens, 'token')} the prefix cache once held: "
                f"{evicted_by}'s blocks evicted them in step {evicted_step}")
    if reason == "salt_mismatch":
        return (f"{seq_id} missed {counted(num_tokens, 'token')} the prefix cache holds under "
                "another cache_salt: requests share a prefix only under one salt")
    return (f"{seq_id} shares {counted(num_tokens, 'token')} past its prefix hit with a "
            "cached block, and they cannot hit: the shared text ends mid-block, and only full "
            "blocks are cached")


def _step_events(record: StepRecord, first_prefill: dict[str, int]) -> list[str]:
    """What one step did that a newcomer should notice, in the order it happened.
    first_prefill: each sequence's first step with a prefill chunk in the records read."""
    lines = []
    step = f"step {record.step}:"
    for request_id, seq_id, kind, start, end in record.chunks:
        if kind == "prefill" and start == 0:
            lines.append(f"{step} admitted {seq_id}: prefilling tokens 0–{end}")
        elif (kind == "prefill" and first_prefill.get(seq_id) == record.step
              and record.prefix_cache_hits):
            # Its first chunk starts past 0: the tokens before came from the prefix cache.
            lines.append(f"{step} admitted {seq_id}: tokens 0–{start} from the prefix "
                         f"cache, prefilling tokens {start}–{end}")
        elif kind == "prefill":
            lines.append(f"{step} {seq_id} prefilled its next chunk, tokens {start}–{end} "
                         "(chunked prefill)")
    if record.prefix_cache_hits:
        lines.append(f"{step} the prefix cache supplied {record.prefix_cache_hits} of "
                     f"{record.prefix_cache_queries} prompt tokens looked up: their blocks "
                     "are shared, not recomputed")
    for cause in record.prefix_misses:
        lines.append(f"{step} {miss_words(cause)}")
    swapped = set(record.swapped_out)
    for cause in record.preemptions:
        lines.append(f"{step} preempted {cause[0]} {preemption_words(cause, swapped)}")
    for seq_id in record.swapped_out:
        lines.append(f"{step} swapped {seq_id} out to CPU memory to free its device blocks")
    for seq_id in record.swapped_in:
        lines.append(f"{step} swapped {seq_id} back in")
    for request_id in record.finished:
        lines.append(f"{step} {request_id} finished: its blocks are freed, the full ones "
                     "stay cached for a later prefix hit")
    return lines


def event_lines(records: Sequence[StepRecord], evictions: Sequence[Evictions] = (),
                limit: int = MAX_EVENTS) -> list[str]:
    """The newest `limit` events, newest first."""
    evicted = {event.step: event.num_blocks for event in evictions}
    scanned = records[-MAX_SCANNED_STEPS:]
    first_prefill: dict[str, int] = {}
    for record in scanned:
        for _, seq_id, kind, _, _ in record.chunks:
            if kind == "prefill":
                first_prefill.setdefault(seq_id, record.step)
    lines: list[str] = []
    for record in reversed(scanned):
        if record.step in evicted:
            lines.append(f"step {record.step}: evicted "
                         f"{counted(evicted[record.step], 'cached block')}, least recently "
                         "used first, to make room")
        lines.extend(reversed(_step_events(record, first_prefill)))
        if len(lines) >= limit:
            break
    return lines[:limit]


def events_markdown(records: Sequence[StepRecord], evictions: Sequence[Evictions] = ()) -> str:
    lines = event_lines(records, evictions)
    if not lines:
        return "**Events** · none yet: admissions, prefix hits and misses, preemptions and " \
               "evictions appear here as they happen."
    return "**Events** (newest first)\n\n" + "\n".join(f"- {line}" for line in lines)
