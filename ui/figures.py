"""Plotly figures of the KV cache, read from a reader's PoolMirror (never the live pool).

Every figure is bounded whatever the pool's size: the heatmap draws at most MAX_CELLS
cells (a cell aggregates a block range when the view is larger), the block tables at most
MAX_TABLE_ROWS sequences and MAX_TABLE_COLUMNS blocks each, the prefix tree at most
MAX_TREE_NODES nodes (ui.radix_tree). Each says what it leaves out. Bulk data goes out as
numpy arrays (plotly sends them as compact typed arrays), and per-block hover strings are
built only for the blocks on screen when single blocks are shown.
"""

import base64
import html
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvscope.engine.telemetry.pool_mirror import STATES, PoolMirror, hash_key
from kvscope.ui.palette import (
    MAX_SHADED_REFS,
    SHARED_COLORSCALE,
    STATE_COLORS,
    TEMPLATE,
    UNSHARED_COLORSCALE,
    hover_text,
    state_rgb,
)
from kvscope.ui.plotdata import TITLE, of_request
from kvscope.ui.prefix_forest import prefix_forest
from kvscope.ui.radix_tree import (
    LABEL_FONT_PX,
    MIN_FONT_PX,
    RadixChains,
    drawn_nodes,
    fit,
    fold_label,
    radix_chains,
    text_px,
)
from kvscope.ui.spec_decode import Verification

HEATMAP_COLUMNS = 64
MAX_CELLS = 4096
# Owners, hash and text in the hover of single blocks only up to this many on screen:
# beyond it the hover says block, state and ref count (typed arrays, a few bytes a cell).
MAX_HOVER_DETAIL = 1024
MAX_TABLE_ROWS = 32
MAX_TABLE_COLUMNS = 24  # longer tables show their first and last half of this
# The block tables' plot width assumed at a 1024 px wide page (the panel has a row of its
# own): a cell's id at 10 px type needs about 7 px a digit and some air, so a pool of
# five-digit ids shows fewer columns than one of two-digit ids, and ids never overprint.
TABLE_PLOT_WIDTH_PX = 600
TABLE_ORDERS = ("most recent", "longest", "most shared")
HEATMAP_VIEWS = ("whole pool", "used region", "block range")
Decode = Callable[[tuple[int, ...]], str]
# A figure as plotly's JSON spec: {"data": [trace dicts], "layout": {...}}. Plain dicts
# serialise at once; plotly's object model took a large share of a second per thousands of
# cells (docs/performance-history.md, 'Figures the code's comments quoted').
Figure = dict


def followed_blocks(pool: PoolMirror, request_id: str) -> list[int]:
    """The physical blocks the followed request's sequences hold, in block order; for a
    request that has left the pool, its blocks still cached with its content."""
    held = sorted({block for seq in pool.sequences if of_request(seq.seq_id, request_id)
                   for block in seq.block_table if block >= 0})
    return held or pool.cached_blocks_of(request_id)[0]


def following_words(pool: PoolMirror, follow: str, outlined: int,
                    total: int | None = None) -> str:
    """The title's line on the followed request (`outlined` of its `total` blocks): a
    finished one holds no block, but its cached ones are outlined, and the line says so."""
    if any(of_request(seq.seq_id, follow) for seq in pool.sequences):
        of = "" if total is None else f" of its {total}"
        return f"following {follow}: {outlined}{of} blocks outlined"
    cached, held = pool.cached_blocks_of(follow)
    if not held:
        return f"following {follow}: not in the pool (no block held or cached)"
    return (f"following {follow} (finished): {len(cached)} of the {held} blocks it held are "
            f"still cached, {outlined} outlined")


def _no_decode(token_ids: tuple[int, ...]) -> str:
    return " ".join(map(str, token_ids))


def typed_array(array: np.ndarray) -> dict:
    """plotly.js's typed-array spec: the raw bytes in base64 instead of a JSON number list."""
    array = np.ascontiguousarray(array)
    return {"dtype": array.dtype.str.lstrip("<>|="),
            "bdata": base64.b64encode(array.tobytes()).decode("ascii"),
            "shape": ", ".join(map(str, array.shape))}


def _figure(traces: list[dict], title: str, height: int, right: int = 20,
            **layout) -> Figure:
    # The legend sits above the plot, where it cannot cover an axis title.
    return {"data": traces, "layout": {
        "template": TEMPLATE, "height": height, "plot_bgcolor": "white",
        "title": TITLE | {"text": title},
        "margin": {"l": 60, "r": right, "t": 100, "b": 40},
        "uirevision": "keep",  # keep the person's zoom across ticks
        "legend": {"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0}, **layout}}


def _state_legend(states=tuple(STATE_COLORS)) -> list[dict]:
    """Heatmaps have no per-category legend, so invisible points carry one."""
    return [{"type": "scatter", "x": [None], "y": [None], "mode": "markers", "name": state,
             "marker": {"color": STATE_COLORS[state], "size": 10, "symbol": "square"}}
            for state in states]


def _block_hover(pool: PoolMirror, block_id: int, decode: Decode) -> list:
    block = pool.block_info(block_id)
    return [block.block_id, block.ref_count, block.state,
            ", ".join(block.owners[:3]) + (" …" if len(block.owners) > 3 else "") or "-",
            (block.block_hash or "-")[:12],
            hover_text(decode(block.token_ids), limit=32) if block.token_ids else "-"]


BLOCK_HOVER = ("block %{customdata[0]} · %{customdata[2]} · ref %{customdata[1]}<br>"
               "owners: %{customdata[3]}<br>hash: %{customdata[4]}<br>"
               "text: %{customdata[5]}<extra></extra>")


def _state_traces(codes: np.ndarray, refs: np.ndarray, **common) -> list[dict]:
    """Two heatmaps on one grid: the unshared states (discrete colours) and the shared
    blocks shaded by reference count, with a colour bar saying so. NaN = no cell."""
    unshared = np.where(codes < 3, codes, np.nan).astype(np.float32)
    shared = np.where(codes == 3, np.minimum(refs, MAX_SHADED_REFS), np.nan).astype(np.float32)
    return [
        {"type": "heatmap", "z": typed_array(unshared), "colorscale": UNSHARED_COLORSCALE,
         "zmin": 0, "zmax": 2, "showscale": False, "hoverongaps": False, **common},
        {"type": "heatmap", "z": typed_array(shared), "colorscale": SHARED_COLORSCALE,
         "zmin": 2, "zmax": MAX_SHADED_REFS, "hoverongaps": False, "colorbar": {
             "title": {"text": "ref count", "side": "right"}, "thickness": 12, "len": 0.6,
             "tickvals": list(range(2, MAX_SHADED_REFS + 1)),
             "ticktext": [*map(str, range(2, MAX_SHADED_REFS)), f"{MAX_SHADED_REFS}+"]},
         **common},
    ]


# ---- the pool heatmap ---------------------------------------------------------------------
def heatmap_range(pool: PoolMirror, view: str = "whole pool", start: int | None = None,
                  stop: int | None = None) -> tuple[int, int]:
    """The blocks [start, stop) a view shows; a block range is clamped to the pool."""
    num_blocks = pool.num_blocks
    if view == "used region":
        held = np.flatnonzero(pool.state_codes() != 0)
        if not len(held):
            return 0, min(num_blocks, HEATMAP_COLUMNS)
        return int(held[0]) // HEATMAP_COLUMNS * HEATMAP_COLUMNS, int(held[-1]) + 1
    if view == "block range":
        start = min(max(int(start or 0), 0), max(num_blocks - 1, 0))
        stop = num_blocks if stop is None else min(max(int(stop), start + 1), num_blocks)
        return start, stop
    if view != "whole pool":
        raise ValueError(f"view={view!r} must be one of {list(HEATMAP_VIEWS)}")
    return 0, num_blocks


def pool_heatmap(pool: PoolMirror, decode: Decode = _no_decode, view: str = "whole pool",
                 start: int | None = None, stop: int | None = None,
                 follow: str = "", as_of: int | None = None) -> Figure:
    """The blocks of a view as a rows x 64 grid: one cell per block when the view holds at
    most MAX_CELLS blocks (with hover detail), else one cell per block range. The blocks
    of the followed request (`follow`, a request id) are outlined; `as_of` is the step the
    picture is of (default: the pool's latest)."""
    start, stop = heatmap_range(pool, view, start, stop)
    counts = pool.counts()
    cell = -(-(stop - start) // MAX_CELLS)
    traces, axes = (_exact_heatmap(pool, start, stop, decode) if cell == 1
                    else _aggregate_heatmap(pool, start, stop, cell))
    following = ""
    traces.extend(_group_markers(pool, start, stop, cell))
    if follow:
        blocks = [b for b in followed_blocks(pool, follow) if start <= b < stop]
        traces.append(_outline(blocks, start, cell, follow))
        following = "<br>" + following_words(pool, follow, len(blocks))
    shown = ("the whole pool" if (start, stop) == (0, pool.num_blocks)
             else f"blocks {start}–{stop - 1}")
    detail = ("one cell per block" + ("" if stop - start <= MAX_HOVER_DETAIL else
                                      f"; zoom to {MAX_HOVER_DETAIL} or fewer for owners "
                                      "and text")
              if cell == 1 else
              f"one cell = {cell} blocks, coloured by their mix of states (hover)")
    # Short lines: Plotly does not wrap a title, and a long one is cut at both ends.
    title = (f"Block pool: {pool.num_blocks} blocks x {pool.block_size} tokens<br>"
             + " · ".join(f"{state} {count}" for state, count in counts.items())
             + following + f"<br><sup>{shown}: {detail} · as of step "
             f"{pool.step if as_of is None else as_of}</sup>")
    num_rows = -(-(stop - start) // (cell * HEATMAP_COLUMNS))
    return _figure(traces, title, height=220 + 14 * min(num_rows, 64), right=90, **axes)


# How the heatmap marks the blocks of a model with full and sliding-window KV cache groups.
GROUP_MARKERS = {"full": {"symbol": "circle", "size": 5, "color": "#1f2937"},
                 "sliding": {"symbol": "diamond", "size": 6, "color": "#b45309"}}


def _group_markers(pool: PoolMirror, start: int, stop: int, cell: int) -> list[dict]:
    """For a model with both full and sliding-window groups: a small marker on each cell
    holding blocks of each kind of group, so the heatmap tells the groups apart (the
    sliding ones' blocks come and go as their window moves; the full ones' stay)."""
    windows = pool.group_windows
    kinds = {window is None for window in windows}
    if len(kinds) < 2:
        return []
    groups = pool.block_groups()[start:stop]
    traces = []
    for full in (True, False):
        members = [g for g, window in enumerate(windows) if (window is None) == full]
        blocks = (np.flatnonzero(np.isin(groups, members)) + start).tolist()
        window = next(w for w in windows if w is not None)
        name = "full-attention groups" if full else f"sliding-window groups (W={window})"
        traces.append(_outline(blocks, start, cell, name,
                               GROUP_MARKERS["full" if full else "sliding"]))
    return traces


def _outline(blocks: list[int], start: int, cell: int, request_id: str,
             marker: dict | None = None) -> dict:
    """Open squares (or `marker`) on the cells holding `blocks`, on either heatmap's
    coordinates: the exact one's category rows (row start ids) and columns, or the
    image's cell centres."""
    cells = sorted({(block - start) // cell for block in blocks})
    columns = [index % HEATMAP_COLUMNS for index in cells]
    rows = [index // HEATMAP_COLUMNS for index in cells]
    xs = columns if cell == 1 else [column * cell for column in columns]
    ys = [start + row * cell * HEATMAP_COLUMNS for row in rows]
    return {"type": "scatter", "mode": "markers", "x": xs, "y": ys, "name": request_id,
            "marker": marker or {"symbol": "square-open", "size": 11, "color": "#111827",
                                 "line": {"width": 2}}, "hoverinfo": "skip"}


def _grid(values: np.ndarray, fill) -> np.ndarray:
    """Per-cell values (cells first) as rows of HEATMAP_COLUMNS, the last row padded."""
    num_rows = -(-len(values) // HEATMAP_COLUMNS)
    grid = np.full((num_rows * HEATMAP_COLUMNS, *values.shape[1:]), fill, dtype=values.dtype)
    grid[:len(values)] = values
    return grid.reshape(num_rows, HEATMAP_COLUMNS, *values.shape[1:])


def _exact_heatmap(pool: PoolMirror, start: int, stop: int, decode: Decode):
    codes = _grid(pool.state_codes(start, stop).astype(np.float32), np.nan)
    refs = _grid(pool.ref_counts[start:stop].astype(np.float32), np.nan)
    rows = list(range(start, start + HEATMAP_COLUMNS * codes.shape[0], HEATMAP_COLUMNS))
    if stop - start <= MAX_HOVER_DETAIL:
        hover = [_block_hover(pool, block_id, decode) for block_id in range(start, stop)]
        hover += [None] * (codes.size - len(hover))
        custom = [hover[i:i + HEATMAP_COLUMNS] for i in range(0, len(hover), HEATMAP_COLUMNS)]
        template = BLOCK_HOVER
    else:
        ids = np.arange(start, stop, dtype=np.uint32)
        custom = typed_array(_grid(np.stack([ids, pool.ref_counts[start:stop].astype(
            np.uint32)], axis=1), 0))
        template = "block %{customdata[0]} · ref %{customdata[1]}<extra></extra>"
    traces = _state_traces(codes, refs, customdata=custom, y=rows, hovertemplate=template,
                           xgap=1, ygap=1)
    return traces + _state_legend(("free", "cached", "used")), {
        "yaxis": {"autorange": "reversed", "title": {"text": "first block of the row"},
                  "showgrid": False, "type": "category"},
        "xaxis": {"title": {"text": "block id − row start"}, "showgrid": False}}


def cell_counts(pool: PoolMirror, start: int, stop: int, cell: int) -> np.ndarray:
    """Blocks of each state (columns in STATES order) in each run of `cell` blocks."""
    codes = pool.state_codes(start, stop)
    num_cells = -(-len(codes) // cell)
    padded = np.full(num_cells * cell, -1, np.int8)
    padded[:len(codes)] = codes
    per_cell = padded.reshape(num_cells, cell)
    return np.stack([(per_cell == code).sum(axis=1) for code in range(len(STATES))], 1)


def _aggregate_heatmap(pool: PoolMirror, start: int, stop: int, cell: int):
    counts = cell_counts(pool, start, stop, cell)
    shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    rgb = _grid(np.rint(shares @ state_rgb()).astype(np.uint8), 255)  # padding: white
    image = {
        "type": "image", "z": typed_array(rgb), "x0": 0, "dx": cell, "y0": start,
        "dy": cell * HEATMAP_COLUMNS,
        "customdata": typed_array(_grid(counts.astype(np.min_scalar_type(cell)), 0)),
        "hovertemplate": (f"blocks %{{y}} + %{{x}} … +{cell - 1}<br>used %{{customdata[2]}} · "
                          "shared %{customdata[3]} · cached %{customdata[1]} · free "
                          "%{customdata[0]}<extra></extra>")}
    # An image keeps square pixels unless told not to: a cell is `cell` wide and a row
    # 64 x `cell` tall, so the pool would be a thin strip. Unanchored, it fills the panel.
    return [image, *_state_legend()], {
        "yaxis": {"title": {"text": "first block of the row"}, "showgrid": False,
                  "scaleanchor": False},
        "xaxis": {"title": {"text": "block id − row start"}, "showgrid": False}}


# ---- block tables -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TableView:
    """Which sequences the block-table panel shows: an order, a page and an id filter."""

    order: str = "most recent"
    page: int = 1
    filter: str = ""

    def __post_init__(self) -> None:
        if self.order not in TABLE_ORDERS:
            raise ValueError(f"order={self.order!r} must be one of {list(TABLE_ORDERS)}")
        if self.page < 1:
            raise ValueError(f"page={self.page} must be at least 1")


def _chosen_sequences(pool: PoolMirror, view: TableView,
                      follow: str = "") -> tuple[list, int, int]:
    """The page of sequences to draw, how many hold blocks (after the filter), the pages;
    the followed request's sequences first."""
    holders = [seq for seq in pool.sequences
               if seq.block_table and view.filter.lower() in seq.seq_id.lower()]
    if view.order == "most recent":
        holders.sort(key=lambda seq: seq.arrival_time, reverse=True)
    elif view.order == "longest":
        holders.sort(key=lambda seq: len(seq.block_table), reverse=True)
    else:
        refs = pool.ref_counts
        holders.sort(key=lambda seq: sum(b >= 0 and refs[b] > 1 for b in seq.block_table),
                     reverse=True)
    holders.sort(key=lambda seq: not of_request(seq.seq_id, follow))  # stable: order kept
    num_pages = max(-(-len(holders) // MAX_TABLE_ROWS), 1)
    page = min(view.page, num_pages)
    return holders[(page - 1) * MAX_TABLE_ROWS:page * MAX_TABLE_ROWS], len(holders), num_pages


def table_columns(num_blocks: int) -> int:
    """How many blocks of a table fit a row with ids of this pool's widest id, legibly
    (an even number, at most MAX_TABLE_COLUMNS)."""
    digits = len(str(max(num_blocks - 1, 0)))
    return min(max(TABLE_PLOT_WIDTH_PX // (7 * digits + 12), 4), MAX_TABLE_COLUMNS) // 2 * 2


def _shown_columns(length: int, limit: int) -> list[int]:
    """Logical indices drawn for a table: all, or the first and last half of the limit."""
    if length <= limit:
        return list(range(length))
    half = limit // 2
    return [*range(half), *range(length - half, length)]


def block_table_map(pool: PoolMirror, decode: Decode = _no_decode,
                    view: TableView = TableView(), follow: str = "",
                    verified: dict[str, Verification] | None = None) -> Figure:
    """One row per sequence holding blocks (per KV cache group, for a model with several:
    each group has its own table): logical block index -> physical block id. The followed
    request's rows come first, marked ▶. `verified` (ui.spec_decode.latest_verifications):
    the cells whose slots the pool's latest step verified are outlined, green where the
    written slots were kept, red where rejected ones were released, and a block freed for
    holding only rejected slots is crossed out past its table's end."""
    sequences, num_holders, num_pages = _chosen_sequences(pool, view, follow)
    size = pool.block_size
    limit = table_columns(pool.num_blocks)
    windows = pool.group_windows
    num_groups = len(windows)
    rows = [(seq, group) for seq in sequences for group in range(num_groups)]
    width = min(max((len(seq.block_table) // num_groups for seq in sequences), default=0),
                limit)
    codes = np.full((len(rows), width), np.nan, np.float32)
    refs = np.full((len(rows), width), np.nan, np.float32)
    text, custom = [], []
    truncated = 0
    all_codes = pool.state_codes() if sequences else None
    labels = [("▶ " if of_request(seq.seq_id, follow) else "") + f"{seq.seq_id} ({seq.status})"
              + ("" if num_groups == 1 else f" · group {group}: "
                 + ("full" if windows[group] is None else f"window {windows[group]}"))
              for seq, group in rows]
    marks = VerificationMarks(size)
    for row, (seq, group) in enumerate(rows):
        table = seq.block_table[group::num_groups]
        columns = _shown_columns(len(table), limit)
        if verified and seq.seq_id in verified:
            marks.add(labels[row], seq, len(table), columns, verified[seq.seq_id])
        truncated += len(columns) < len(table)
        ids = np.array([table[index] for index in columns], np.int64)
        held = ids >= 0  # a sliding window's RELEASED entries (-1): freed, drawn blank
        codes[row, :len(ids)] = np.where(held, all_codes[ids], np.nan)
        refs[row, :len(ids)] = np.where(held, pool.ref_counts[ids], np.nan)
        last = len(table) - 1
        fill = min(seq.num_tokens - last * size, size)
        # The last block's fill on a second line: the id's width stays the id's.
        text.append([("freed" if b < 0 else str(b) if index < last else f"{b}<br>{fill}/{size}")
                     for index, b in zip(columns, ids.tolist())] + [""] * (width - len(ids)))
        custom.append([None if b < 0 else [index, *_block_hover(pool, b, decode)[1:]]
                       for index, b in zip(columns, ids.tolist())] + [None] * (width - len(ids)))
    traces = _state_traces(
        codes, refs, y=labels, text=text, texttemplate="%{text}", textfont={"size": 10},
        customdata=custom, xgap=2, ygap=2, hovertemplate=BLOCK_HOVER.replace(
            "block %{customdata[0]}", "logical block %{customdata[0]}"))
    columns_note = (f"<br><sup>{truncated} tables longer than {limit} blocks: their first and "
                    f"last {limit // 2} shown (−1 = the last; hover a cell for its index)</sup>"
                    if truncated else "")
    axes = {"yaxis": {"autorange": "reversed", "type": "category", "automargin": True},
            "xaxis": {"title": {"text": "logical block → physical block id (last: tokens "
                                        "in it / block size)"}}}
    if truncated:  # the right half of a long table counts from its end: -1 is its last
        half = limit // 2
        axes["xaxis"] |= {"tickvals": list(range(width)), "ticktext": [
            str(column) if column < half else str(column - limit) for column in range(width)]}
    filtered = f" matching “{view.filter}”" if view.filter else ""
    title = (f"Block tables: {len(sequences)} of {num_holders} sequences holding blocks"
             f"{filtered}<br>{view.order} first · page {min(view.page, num_pages)} of "
             f"{num_pages}" + columns_note)
    if not sequences:
        title = ("Block tables: no request holds blocks right now" if not num_holders
                 else f"Block tables: none of {num_holders} sequences{filtered}")
    return _figure(traces + marks.traces() + _state_legend(("used",)), title,
                   height=200 + 32 * len(rows), right=90, **axes)


class VerificationMarks:
    """The block-table cells a step's verifications touched, as marker traces over the
    grid: written slots kept, rejected slots released in a kept block, and blocks freed
    for holding only rejected slots (past the table's end, where they were)."""

    KINDS = {"kept": ("written, kept", "square-open", "#16a34a"),
             "released": ("rejected: slots released", "square-open", "#dc2626"),
             "freed": ("rejected: block freed", "x-thin-open", "#dc2626")}

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.points: dict[str, tuple[list, list, list]] = {kind: ([], [], [])
                                                           for kind in self.KINDS}

    def add(self, label: str, seq, table_length: int, columns: list[int],
            verification: Verification) -> None:
        """One row's marks. Drawn only while the table is as the verification left it: the
        sequence has computed exactly its kept tokens and holds their blocks (a step
        published mid-way has already given it blocks for new proposals)."""
        size, v = self.block_size, verification
        if seq.num_computed_tokens != v.kept or table_length != -(-v.kept // size):
            return
        shown = {index: column for column, index in enumerate(columns)}
        for index in range(v.start // size, (v.end - 1) // size + 1):
            low, high = index * size, (index + 1) * size
            kept = max(min(high, v.kept) - max(low, v.start), 0)
            released = max(min(high, v.end) - max(low, v.kept), 0)
            if index >= table_length:
                kind, column = "freed", len(columns) + index - table_length
            elif index in shown:
                kind, column = ("released" if released else "kept"), shown[index]
            else:
                continue  # in the middle of a long table, not drawn
            x, y, hover = self.points[kind]
            x.append(column)
            y.append(label)
            hover.append(f"step {v.step}, logical block {index}: {kept} slot(s) written and "
                         f"kept, {released} rejected and released"
                         + (" (the block went back to the pool)" if kind == "freed" else ""))

    def traces(self) -> list[dict]:
        return [{"type": "scatter", "mode": "markers", "name": name, "x": x, "y": y,
                 "customdata": hover, "hovertemplate": "%{customdata}<extra></extra>",
                 "marker": {"symbol": symbol, "size": 24, "color": color,
                            "line": {"width": 3, "color": color}}}
                for kind, (name, symbol, color) in self.KINDS.items()
                for x, y, hover in [self.points[kind]] if x]


# ---- the prefix tree ----------------------------------------------------------------------
TREE_HOVER = ("%{customdata[0]} · %{customdata[1]} · ref %{customdata[2]}<br>"
              "owners: %{customdata[3]}<br>hash of the last: %{customdata[4]}<br>"
              "text: %{customdata[5]}<br>prefix hits: %{customdata[6]} · "
              "eviction order: %{customdata[7]}<extra></extra>")
HOVER_TOKENS = 128  # of a node's text in its hover; the rest is counted
HOVER_LINE_CHARS = 64
TREE_LEVELS = 8  # levels on screen at once (click a node to zoom into its subtree)
LEVEL_PX = 44  # two lines of LABEL_FONT_PX text and plotly's padding


def _marks_line(marks: dict[str, str], width_px: float) -> str:
    """A node's marks that fit its width, the least telling left out first (its hover says
    them all): the chain's length, its eviction place, its hits, the state slot's mark."""
    shown = {name: mark for name, mark in marks.items() if mark}
    for name in ("blocks", "place", "hits", "state"):
        if text_px(" ".join(shown.values())) <= width_px:
            break
        shown.pop(name, None)
    return " ".join(shown.values())


class _ChainNodes:
    """Label, hover and marks of the drawn chains of one prefix_tree call."""

    def __init__(self, pool: PoolMirror, forest, chains: RadixChains, decode: Decode,
                 snapshot_after: np.ndarray) -> None:
        self.pool, self.forest, self.chains, self.decode = pool, forest, chains, decode
        self.snapshot_after = snapshot_after
        self.num_evictable = int(np.count_nonzero(pool.state_codes() == 1))

    def text(self, head: int) -> tuple[str, int]:
        """The chain's text up to HOVER_TOKENS tokens, and how many tokens it leaves out."""
        pool, size = self.pool, self.pool.block_size
        tokens = [token for node in self.chains.nodes(self.forest, head, -(-HOVER_TOKENS // size))
                  for token in pool.hashes[int(self.forest.block_ids[node])][2]]
        total = int(self.chains.length[head]) * size
        return self.decode(tuple(tokens[:HOVER_TOKENS])), max(total - HOVER_TOKENS, 0)

    def label_and_hover(self, head: int, width_px: float, undrawn: int) -> tuple[str, list]:
        pool, forest, chains = self.pool, self.forest, self.chains
        tail, length = int(chains.tail[head]), int(chains.length[head])
        first, last = int(forest.block_ids[head]), int(forest.block_ids[tail])
        block = pool.block_info(first)
        hits, last_hits = int(pool.hit_counts[first]), int(pool.hit_counts[last])
        place, last_place = int(chains.first_place[head]), int(chains.last_place[head])
        text, left_out = self.text(head)
        # Whitespace runs as one space, a text of spaces only as visible ones.
        line = " ".join(text.replace("\n", "⏎").split()) or "␣" * len(text)
        marks = _marks_line({"blocks": f"{length} blocks" if length > 1 else "",
                             "hits": f"×{hits}" if hits else "",
                             "place": f"#{place}" if place else "",
                             "state": "state" if self.snapshot_after[tail] else ""}, width_px)
        label = "<br>".join(part for part in (html.escape(fit(line, width_px)), marks) if part)
        blocks = [int(forest.block_ids[node]) for node in chains.nodes(forest, head, 3)]
        ids = ", ".join(map(str, blocks)) + ("" if length <= 3 else
                                             f" … {last} ({length} blocks)")
        ids = ("block " if length == 1 else "blocks ") + ids + (
            f" · {undrawn} smaller branches below not drawn" if undrawn else "")
        wrapped = textwrap.wrap(line, HOVER_LINE_CHARS) or ["-"]
        hover_lines = "<br>".join(map(html.escape, wrapped)) + (
            f" … (+{left_out} tokens)" if left_out else "")
        owners = ", ".join(block.owners[:3]) + (" …" if len(block.owners) > 3 else "")
        eviction = ((f"#{place}" if place == last_place else f"#{place} to #{last_place}")
                    + f" of {self.num_evictable}, 1 = evicted next" if place else
                    "in use: not evictable")
        return label, [ids, block.state, block.ref_count, owners or "-",
                       pool.hashes[last][0].hex()[:12], hover_lines,
                       hits if hits == last_hits else
                       f"{hits} on the first block, {last_hits} on the last", eviction]


def prefix_tree(pool: PoolMirror, decode: Decode = _no_decode, follow: str = "",
                snapshots: frozenset[str] = frozenset()) -> Figure:
    """The hash chains of every hashed block as a radix tree (ui.radix_tree), drawn as an
    icicle: a node is a chain of blocks labelled with its text, shared prefixes are trunks.
    Nodes too narrow to label fold into "+N more"; at most MAX_TREE_NODES are drawn.
    Linking, weighing and chaining the blocks is numpy; Python touches only the nodes
    drawn. The followed request's blocks (`follow`, a request id) are outlined: its path
    down the tree. `snapshots`: the hashes (hex) of the blocks after which a state slot
    keeps a snapshot (SlotTable); a chain ends at each."""
    forest = prefix_forest(pool)
    order = pool.eviction_order()
    rank = np.zeros(pool.num_blocks, np.int64)  # 1 = the next block an allocation evicts
    rank[order] = np.arange(1, len(order) + 1)
    followed = followed_blocks(pool, follow) if follow else []
    on_path = np.isin(forest.block_ids, followed)
    refs = pool.ref_counts[forest.block_ids].astype(np.int64)
    snapshot_after = np.isin(pool.hash_keys[forest.block_ids], np.array(
        [hash_key(bytes.fromhex(value)) for value in snapshots], np.uint64))
    chains = radix_chains(forest, 2 * refs + on_path, snapshot_after, rank[forest.block_ids])
    nodes = _ChainNodes(pool, forest, chains, decode, snapshot_after)
    drawn = drawn_nodes(forest, chains)
    ids, labels, parents, colors, outlined, custom = [], [], [], [], [], []
    for node in drawn:
        if node.parent < 0:
            ids.append("root")
            label, hover, color = "cache", [
                f"{len(forest)} hashed blocks" + (f" · {node.undrawn} branches not drawn"
                                                  if node.undrawn else ""), *"-------"], "white"
        elif node.head < 0:
            ids.append(f"{ids[node.parent]}/more")
            label, color = fold_label(node.folded), "#f3f4f6"
            hover = [f"{node.folded} narrower branches folded: click to open", *"-------"]
        else:
            tail = int(chains.tail[node.head])
            ids.append(pool.hashes[int(forest.block_ids[tail])][0].hex())
            label, hover = nodes.label_and_hover(node.head, node.width_px, node.undrawn)
            color = STATE_COLORS[hover[1]]
        parents.append("" if node.parent < 0 else ids[node.parent])
        labels.append(label)
        colors.append(color)
        outlined.append(node.head >= 0 and bool(on_path[node.head]))
        custom.append(hover)
    icicle = {"type": "icicle", "ids": ids, "labels": labels, "parents": parents,
              "values": [node.value for node in drawn], "branchvalues": "total",
              "textinfo": "label", "textfont": {"size": LABEL_FONT_PX},
              "marker": {"colors": colors, "line": {
                  "color": ["#111827" if path else "white" for path in outlined],
                  "width": [3 if path else 1 for path in outlined]}},
              "customdata": custom, "hovertemplate": TREE_HOVER,
              "tiling": {"orientation": "v"}, "maxdepth": TREE_LEVELS,
              # The path bar shortens its labels with "...": a click on the top node of a
              # zoomed view zooms back out instead.
              "pathbar": {"visible": False}}
    # Block-table entries beyond the physical blocks they point at: what sharing prefixes
    # (and forks) saves the pool right now.
    title = (f"Prefix tree: {len(forest)} hashed blocks in "
             f"{int(np.count_nonzero(chains.is_head))} chains<br>"
             f"{pool.blocks_saved_by_sharing} blocks saved by sharing right now")
    if not len(forest):
        title += " — nothing cached yet" + (
            "" if pool.config.get("enable_prefix_caching", True) else
            " (prefix caching is off)")
    if follow:
        title += "<br>" + following_words(pool, follow, int(on_path.sum()), len(followed))
    title += ("<br><sup>a node: a chain of blocks and its text · size = 1 + ref count</sup>"
              "<br><sup>×N: prefix hits · #k: eviction order (#1 goes next) · click: zoom</sup>")
    return _figure([icicle], title, height=100 + TREE_LEVELS * LEVEL_PX + 10,
                   margin={"l": 10, "r": 10, "t": 100, "b": 10},
                   uniformtext={"minsize": MIN_FONT_PX, "mode": "hide"})


# ---- paged against contiguous -------------------------------------------------------------
@dataclass(slots=True)
class MemoryComparison:
    """Live sequences held by the paged pool against a max_model_len-per-request allocator."""

    num_sequences: int
    stored_tokens: int  # KV rows the sequences need, counting shared prefixes per sequence
    paged_reserved_tokens: int  # blocks in use x block_size
    paged_stored_tokens: int  # rows actually in those blocks (shared ones once)
    contiguous_reserved_tokens: int
    pool_tokens: int
    max_model_len: int
    # what the paged pool would reserve had no sliding window freed a block
    full_attention_reserved_tokens: int

    @property
    def paged_useful(self) -> float:
        return (self.paged_stored_tokens / self.paged_reserved_tokens
                if self.paged_reserved_tokens else 1.0)

    @property
    def contiguous_useful(self) -> float:
        return (self.stored_tokens / self.contiguous_reserved_tokens
                if self.contiguous_reserved_tokens else 1.0)

    @property
    def contiguous_capacity(self) -> int:
        """Requests a contiguous allocator fits in the same pool."""
        return self.pool_tokens // self.max_model_len


def compare_memory(pool: PoolMirror) -> MemoryComparison:
    holders = [seq for seq in pool.sequences if seq.block_table]
    max_model_len = pool.config.get("max_model_len") or pool.block_size
    in_use = int(np.count_nonzero(pool.ref_counts > 0))
    return MemoryComparison(
        num_sequences=len(holders),
        stored_tokens=sum(seq.num_computed_tokens for seq in holders),
        paged_reserved_tokens=in_use * pool.block_size,
        paged_stored_tokens=pool.num_used_tokens,
        contiguous_reserved_tokens=len(holders) * max_model_len,
        pool_tokens=pool.num_blocks * pool.block_size,
        max_model_len=max_model_len,
        full_attention_reserved_tokens=(in_use + pool.blocks_released_by_window)
        * pool.block_size)


def paged_vs_contiguous(pool: PoolMirror) -> Figure:
    """Stacked bars: useful KV rows against reserved-but-empty, for both allocators."""
    c = compare_memory(pool)
    rows = ["contiguous<br>(max_model_len each)", "paged (kvscope)"]
    useful = [c.stored_tokens, c.paged_stored_tokens]
    wasted = [c.contiguous_reserved_tokens - c.stored_tokens,
              c.paged_reserved_tokens - c.paged_stored_tokens]
    # Each bar says its total: paged is a sliver next to contiguous, which is the point.
    reserved = [c.contiguous_reserved_tokens, c.paged_reserved_tokens]
    bars = [
        {"type": "bar", "y": rows, "x": useful, "name": "tokens stored", "orientation": "h",
         "marker": {"color": STATE_COLORS["used"]}},
        {"type": "bar", "y": rows, "x": wasted, "name": "reserved, empty", "orientation": "h",
         "marker": {"color": "#f8fafc", "line": {"color": "#94a3b8", "width": 1},
                    "pattern": {"shape": "/", "fgcolor": "#94a3b8"}},
         "text": [f"{total} reserved" for total in reserved], "textposition": "outside",
         "cliponaxis": False},
    ]
    # The pool's size as a dotted line; its label sits inside the plot, left of the line,
    # so the right edge never cuts it off.
    pool_line = {"type": "line", "xref": "x", "yref": "paper", "x0": c.pool_tokens,
                 "x1": c.pool_tokens, "y0": 0, "y1": 1, "line": {"dash": "dot"}}
    label = {"xref": "x", "yref": "paper", "x": c.pool_tokens, "y": 1, "xanchor": "right",
             "yanchor": "top", "showarrow": False, "text": f"pool: {c.pool_tokens} tokens"}
    shapes, annotations = [pool_line], [label]
    if c.full_attention_reserved_tokens > c.paged_reserved_tokens:
        shapes.append(window_line := {**pool_line, "x0": c.full_attention_reserved_tokens,
                                      "x1": c.full_attention_reserved_tokens,
                                      "line": {"dash": "dash", "color": "#b45309"}})
        annotations.append({**label, "x": window_line["x0"], "y": 0, "yanchor": "bottom",
                            "text": "full attention would hold "
                                    f"{c.full_attention_reserved_tokens} tokens"})
    fits = min(c.num_sequences, c.contiguous_capacity)
    title = (f"Useful memory, {c.num_sequences} live sequences:<br>paged "
             f"{c.paged_useful:.0%}, contiguous {c.contiguous_useful:.0%} (published: "
             f"20.4–38.2%)<br><sup>contiguous fits {fits} of them (room for "
             f"{c.contiguous_capacity})</sup>")
    # Token counts are never negative: no "-100k" tick left of the bars.
    return _figure(bars, title, height=320, barmode="stack", shapes=shapes,
                   annotations=annotations,
                   xaxis={"rangemode": "nonnegative", "title": {"text": "tokens"}})
