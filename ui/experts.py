"""The Experts panel (mixture-of-experts models only): per MoE layer, how many tokens each
expert took over the recent steps (a layers x experts heatmap), and per step the bytes of
expert weights read against what a dense model of the same size reads of them."""

from collections.abc import Sequence

import numpy as np

from kvscope.engine.telemetry.experts import WINDOW_STEPS, recent_counts
from kvscope.engine.telemetry.records import StepRecord
from kvscope.ui.figures import typed_array
from kvscope.ui.palette import EXPERT_COLORS, EXPERT_COLORSCALE, TEMPLATE
from kvscope.ui.plotdata import TITLE, Figure, epoch_ms, placeholder
from kvscope.ui.timeline import _date_axis, in_window

MIB = 1024 * 1024
# The heatmap above, the bytes per step below (fractions of the plot's height).
HEATMAP_DOMAIN = [0.42, 1.0]
BYTES_DOMAIN = [0.0, 0.28]


def experts_panel(records: Sequence[StepRecord], window: tuple[float, float] | None = None,
                  steps: int = WINDOW_STEPS) -> Figure:
    """The heatmap sums the last `steps` steps that ran a forward; the bytes line covers the
    time window the other live panels share (`window`)."""
    layers, counts, summed = recent_counts(records, steps)
    if not summed:
        return placeholder("Experts", "No step has run the model yet.")
    routed = [record for record in in_window(records, window) if record.expert_tokens]
    times = [epoch_ms(record.end_time) for record in routed]
    read = [record.expert_bytes_read / MIB for record in routed]
    everything = [record.expert_bytes_all / MIB for record in routed]
    top_k_tokens = int(counts[0].sum())
    data = [
        {"type": "heatmap", "z": typed_array(counts.astype(np.int32)), "x": list(range(counts.shape[1])),
         "y": [f"layer {layer}" for layer in layers], "colorscale": EXPERT_COLORSCALE,
         "colorbar": {"title": {"text": "tokens"}, "len": HEATMAP_DOMAIN[1] - HEATMAP_DOMAIN[0],
                      "y": HEATMAP_DOMAIN[1], "yanchor": "top"},
         "hovertemplate": "%{y}, expert %{x}: %{z} tokens<extra></extra>"},
        {"type": "scatter", "mode": "lines", "name": "expert weights read", "x": times,
         "y": read, "xaxis": "x2", "yaxis": "y2", "line": {"color": EXPERT_COLORS["read"]},
         "hovertemplate": "%{y:.2f} MiB read<extra></extra>"},
        {"type": "scatter", "mode": "lines", "name": "a dense model of the same size",
         "x": times, "y": everything, "xaxis": "x2", "yaxis": "y2",
         "line": {"color": EXPERT_COLORS["dense"], "dash": "dash"},
         "hovertemplate": "%{y:.2f} MiB<extra></extra>"},
    ]
    share = sum(read) / sum(everything) if everything else 0.0
    title = (f"Experts: tokens each expert took over the last {summed} steps ({top_k_tokens} "
             f"token choices per layer), and the expert weights each step read: "
             f"{share:.0%} of a dense model's"
             "<br><sup>each token runs its top-k experts; a step reads each expert its "
             "tokens chose once, a dense model of the same size reads them all</sup>")
    return {"data": data, "layout": {
        "template": TEMPLATE, "plot_bgcolor": "white", "uirevision": "keep",
        "height": 180 + 14 * len(layers) + 160,
        "title": {**TITLE, "text": title}, "margin": {"l": 80, "r": 60, "t": 80, "b": 40},
        "xaxis": {"title": {"text": "expert"}, "anchor": "y"},
        "yaxis": {"domain": HEATMAP_DOMAIN, "autorange": "reversed", "type": "category"},
        "xaxis2": _date_axis(window, anchor="y2"),
        "yaxis2": {"domain": BYTES_DOMAIN, "title": {"text": "MiB per step"},
                   "rangemode": "tozero"},
        "legend": {"orientation": "h", "y": BYTES_DOMAIN[1] + 0.02, "yanchor": "bottom",
                   "x": 0}}}
