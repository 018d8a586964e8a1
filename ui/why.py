"""Why a followed request waited: its queueing, its preemptions (why, for whom, what they
cost), the preemptions it caused, its prefix-cache hits and misses (why), and the prefixes
its allocations evicted, from the step records kept."""

from collections.abc import Sequence

from kvscope.engine.telemetry.records import StepRecord
from kvscope.ui.events import miss_words, preemption_words
from kvscope.ui.plotdata import of_request


def why_lines(records: Sequence[StepRecord], arrivals: dict[str, float],
              request_id: str) -> list[str]:
    """The followed request's story, oldest first (empty: no step of it is kept)."""
    lines: list[str] = []
    running: set[str] = set()  # its sequences computing since they last (re)started
    arrival = arrivals.get(request_id)
    for record in records:
        step = f"step {record.step}:"
        swapped = set(record.swapped_out)
        for chunk_request, seq_id, kind, start, end in record.chunks:
            if chunk_request != request_id or seq_id in running:
                continue
            if not lines and arrival is not None:
                lines.append(f"{step} {seq_id} started after waiting "
                             f"{record.start_time - arrival:.3f} s in the queue")
            else:
                lines.append(f"{step} {seq_id} (re)started")
            if start:
                lines[-1] += f"; the prefix cache supplied tokens 0–{start}, not recomputed"
            running.add(seq_id)
        for miss in record.prefix_misses:
            if of_request(miss[0], request_id) or miss[3] == request_id:  # missed, or evictor
                lines.append(f"{step} {miss_words(miss)}")
        for cause in record.preemptions:
            victim, taker = cause[0], cause[2]
            if of_request(victim, request_id):
                lines.append(f"{step} {victim} preempted {preemption_words(cause, swapped)}")
                running.discard(victim)
            elif of_request(taker, request_id):
                lines.append(f"{step} {taker} took the blocks of {victim} "
                             f"{preemption_words(cause, swapped)}")
        if request_id in record.finished:
            lines.append(f"{step} {request_id} finished")
    return lines


def why_markdown(records: Sequence[StepRecord], arrivals: dict[str, float],
                 request_id: str) -> str:
    lines = why_lines(records, arrivals, request_id)
    if not lines:
        return (f"**Why: {request_id}** · no step of it in the steps kept (it has not "
                "started, or ran before them).")
    return f"**Why: {request_id}**\n\n" + "\n".join(f"- {line}" for line in lines)
