"""One colour per block state, shared by every figure so a block looks the same everywhere."""

import html

STATE_COLORS = {
    "free": "#e5e7eb",
    "cached": "#60a5fa",
    "used": "#22c55e",
    "shared": "#f59e0b",
}
SHARED_MAX_COLOR = "#b91c1c"
# Heatmap cells carry a number: free 0, cached 1, used 2, shared 3..4 (darker = more refs).
STATE_CODES = {"free": 0.0, "cached": 1.0, "used": 2.0, "shared": 3.0}
MAX_SHADED_REFS = 8
COLORSCALE = [
    [0.0, STATE_COLORS["free"]], [0.125, STATE_COLORS["free"]],
    [0.125, STATE_COLORS["cached"]], [0.375, STATE_COLORS["cached"]],
    [0.375, STATE_COLORS["used"]], [0.625, STATE_COLORS["used"]],
    [0.625, STATE_COLORS["shared"]], [0.75, STATE_COLORS["shared"]],
    [1.0, SHARED_MAX_COLOR],
]
PHASE_COLORS = {
    "waiting": "#d1d5db",
    "prefill": "#8b5cf6",
    "decode": "#22c55e",
    "preempted": "#ef4444",
    "finished": "#111827",
}


def state_code(state: str, ref_count: int) -> float:
    """The heatmap value of a block: its state, and for shared blocks how shared."""
    if state != "shared":
        return STATE_CODES[state]
    return 3.0 + min(ref_count - 2, MAX_SHADED_REFS - 2) / (MAX_SHADED_REFS - 2)


def code_state(code: float) -> str:
    """Inverse of state_code (for tests and hover)."""
    return "shared" if code >= 3 else next(s for s, c in STATE_CODES.items() if c == code)


def hover_text(text: str, limit: int = 48) -> str:
    """Token text safe for a Plotly hover: special tokens like <|im_end|> are not tags."""
    text = text if len(text) <= limit else text[:limit] + "…"
    return html.escape(text).replace("\n", "⏎")
