"""Speculative decoding's panel: per step, the tokens proposed, accepted and rejected, and
over time the acceptance rate and the tokens each verifying forward yielded; and the slots
a step's verifications wrote and released, for the block tables to outline."""

from collections.abc import Sequence
from dataclasses import dataclass

from kvscope.engine.telemetry.records import StepRecord
from kvscope.ui.plotdata import Figure, epoch_ms, placeholder
from kvscope.ui.timeline import _date_axis, in_window

COLORS = {"accepted": "#2ca02c", "rejected": "#d62728", "rate": "#1f77b4",
          "tokens": "#ff7f0e"}


def spec_decode_panel(records: Sequence[StepRecord],
                      window: tuple[float, float] | None = None) -> Figure:
    steps = [r for r in in_window(records, window) if r.spec_drafts]
    if not steps:
        return placeholder("Speculative decoding", "No proposals verified in this window "
                           "(speculative_config off, or nothing to propose).")
    times = [epoch_ms(r.end_time) for r in steps]
    proposed = [sum(d[1] for d in r.spec_drafts) for r in steps]
    accepted = [sum(d[2] for d in r.spec_drafts) for r in steps]
    drafts = [len(r.spec_drafts) for r in steps]
    hover = [", ".join(f"{seq}: {a}/{p}" for seq, p, a in r.spec_drafts) for r in steps]
    data = [
        {"type": "bar", "name": "accepted", "x": times, "y": accepted, "customdata": hover,
         "marker": {"color": COLORS["accepted"]},
         "hovertemplate": "%{y} accepted<br>%{customdata}<extra></extra>"},
        {"type": "bar", "name": "rejected", "x": times,
         "y": [p - a for p, a in zip(proposed, accepted)],
         "marker": {"color": COLORS["rejected"]}, "hovertemplate": "%{y} rejected<extra></extra>"},
        {"type": "scatter", "mode": "lines", "name": "acceptance rate", "x": times,
         "y": [a / p for a, p in zip(accepted, proposed)], "yaxis": "y2",
         "line": {"color": COLORS["rate"]}},
        {"type": "scatter", "mode": "lines", "name": "tokens per verifying forward", "x": times,
         "y": [1 + a / d for a, d in zip(accepted, drafts)], "yaxis": "y3",
         "line": {"color": COLORS["tokens"], "dash": "dot"}},
    ]
    total_p, total_a = sum(proposed), sum(accepted)
    return {"data": data, "layout": {
        "barmode": "stack", "height": 320, "uirevision": "keep",
        "title": {"text": f"Speculative decoding: {total_a} of {total_p} proposed tokens "
                          f"accepted ({total_a / total_p:.0%})"},
        "margin": {"l": 60, "r": 60, "t": 60, "b": 40}, "xaxis": _date_axis(window),
        "yaxis": {"title": {"text": "tokens per step"}},
        "yaxis2": {"overlaying": "y", "side": "right", "range": [0, 1],
                   "title": {"text": "acceptance"}},
        "yaxis3": {"overlaying": "y", "side": "right", "visible": False, "rangemode": "tozero"},
        "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0}}}


@dataclass(frozen=True, slots=True)
class Verification:
    """One sequence's verifying chunk in one step: it wrote K/V at positions [start, end);
    [start, kept) hold its last token and the accepted proposals, [kept, end) the rejected
    ones, whose slots were released (a block left holding only those went back to the
    pool)."""

    step: int
    start: int
    kept: int
    end: int


def latest_verifications(records: Sequence[StepRecord], pool_step: int
                         ) -> dict[str, Verification]:
    """Per sequence, the verification of the step a pool published as of `pool_step` (its
    counters' step: steps done) was left by; {} when that step's record is not among
    `records` or verified nothing."""
    record = next((r for r in reversed(records) if r.step == pool_step - 1), None)
    if record is None or not record.spec_drafts:
        return {}
    chunks = {chunk[1]: chunk for chunk in record.chunks}
    return {seq_id: Verification(record.step, chunks[seq_id][3],
                                 chunks[seq_id][3] + 1 + accepted, chunks[seq_id][4])
            for seq_id, _, accepted in record.spec_drafts}
