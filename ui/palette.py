"""One colour per meaning, shared by every figure so a block looks the same everywhere.

Block states are grey / blue / green / amber-to-brown (shared: darker = more references,
with a colour bar); request phases use colours no block state uses, and red means only
"preempted".
"""

import html

import numpy as np
import plotly.io as pio

STATE_COLORS = {
    "free": "#e5e7eb",
    "cached": "#60a5fa",
    "used": "#22c55e",
    "shared": "#f59e0b",
}
STATE_CODES = {"free": 0, "cached": 1, "used": 2, "shared": 3}  # as PoolMirror.state_codes
# Shared blocks are shaded by reference count from 2 (amber) to MAX_SHADED_REFS+ (brown).
MAX_SHADED_REFS = 8
SHARED_COLORSCALE = [[0.0, STATE_COLORS["shared"]], [1.0, "#78350f"]]
# The unshared states as a discrete scale over their codes 0..2.
UNSHARED_COLORSCALE = [
    [0.0, STATE_COLORS["free"]], [1 / 3, STATE_COLORS["free"]],
    [1 / 3, STATE_COLORS["cached"]], [2 / 3, STATE_COLORS["cached"]],
    [2 / 3, STATE_COLORS["used"]], [1.0, STATE_COLORS["used"]],
]
# The time series' lines, by name: the Live and Sessions tabs draw different sets of lines
# (a logged session has no token-slot samples), and colours by position then differed.
SERIES_COLORS = {
    "blocks in use": STATE_COLORS["used"],
    "token slots filled": "#84cc16",
    "running": "#0d9488",
    "waiting": "#9ca3af",
    "output tokens/s": "#7c3aed",
}
# The Experts panel: tokens per expert from none (white) to many; the bytes read against
# a dense model's.
EXPERT_COLORSCALE = [[0.0, "#ffffff"], [1.0, "#7c3aed"]]
EXPERT_COLORS = {"read": "#7c3aed", "dense": "#6b7280"}
PHASE_COLORS = {
    "waiting": "#d1d5db",
    "prefill": "#8b5cf6",
    "decode": "#0d9488",
    "preempted": "#dc2626",
    "finished": "#111827",
}


# Plotly's default look without its per-trace-type defaults: every figure carries its
# template, and the full one is 7 KB of every refresh.
TEMPLATE = {"layout": {
    key: value for key, value in pio.templates["plotly"].layout.to_plotly_json().items()
    if key not in ("colorscale", "coloraxis", "polar", "ternary", "scene", "geo")}}


def state_rgb() -> np.ndarray:
    """The four state colours as a (4, 3) array in code order, for mixing by share."""
    return np.array([[int(color[i:i + 2], 16) for i in (1, 3, 5)]
                     for color in STATE_COLORS.values()], dtype=np.float32)


def hover_text(text: str, limit: int = 48) -> str:
    """Token text safe for a Plotly hover: special tokens like <|im_end|> are not tags."""
    text = text if len(text) <= limit else text[:limit] + "…"
    return html.escape(text).replace("\n", "⏎")
