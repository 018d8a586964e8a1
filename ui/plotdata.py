"""Plotly figures as plain dicts, serialized once, and the placeholder of an empty panel.

plotly.graph_objects validates every value it is given: for a live panel rebuilt every
second that costs more than building the data itself, in the engine's own process. The
time-series builders write Plotly's JSON schema directly and hand Gradio the string.
"""

import gradio as gr
import orjson
from gradio.components.plot import PlotData

Figure = dict
# Every plot carries this class (panel()): its label then sits in the page's flow, above the
# chart (ui/dashboard.css), not over the chart's title.
PANEL_CLASS = "kv-panel"


def panel(label: str, elem_id: str | None = None, visible: bool = True) -> gr.Plot:
    """A plot panel of the page (every gr.Plot is made here)."""
    return gr.Plot(label=label, elem_id=elem_id, elem_classes=PANEL_CLASS, visible=visible)

# Titles start at the top left of the figure and push the plot down as far as their lines
# need (automargin): centred, a long title was cut at both ends; placed by a fraction of
# the height, a short figure's multi-line title was cut at its top. (Plotly sets a title's
# first line about 15 px above its anchor: the top pad leaves room for that.)
TITLE = {"x": 0.0, "xanchor": "left", "xref": "container", "y": 1.0, "yanchor": "top",
         "yref": "container", "pad": {"t": 20, "l": 8}, "automargin": True}


def to_plot(figure) -> PlotData:
    """What gr.Plot sends, serialized once (then shared by every tab): from a dict figure,
    or from a plotly go.Figure."""
    if isinstance(figure, dict):
        return PlotData(type="plotly", plot=orjson.dumps(figure).decode())
    return PlotData(type="plotly", plot=figure.to_json())


def placeholder(title: str, message: str, height: int = 200) -> Figure:
    """An empty panel that says why it is empty, with no axes, ticks or legend."""
    hidden = {"visible": False, "range": [0, 1]}
    return {"data": [], "layout": {
        "title": {"text": title}, "height": height, "xaxis": hidden, "yaxis": hidden,
        "showlegend": False, "plot_bgcolor": "white",
        "margin": {"l": 20, "r": 20, "t": 50, "b": 20},
        "annotations": [{"text": message, "x": 0.5, "y": 0.5, "xref": "paper",
                         "yref": "paper", "showarrow": False, "font": {"size": 14,
                                                                        "color": "#6b7280"}}]}}


def epoch_ms(seconds: float) -> float:
    """Plotly date axes take milliseconds since the epoch."""
    return round(seconds * 1000, 1)


def of_request(seq_id: str, request_id: str) -> bool:
    """Whether a sequence belongs to a request (its id, or the id and #sample): how every
    panel finds the request a tab follows."""
    return bool(request_id) and (seq_id == request_id or seq_id.startswith(request_id + "#"))
