"""Plotly figures of the KV cache, built from one EngineSnapshot (never the live pool)."""

from collections.abc import Callable
from dataclasses import dataclass

import plotly.graph_objects as go

from engine.telemetry import BlockInfo, EngineSnapshot
from ui.palette import COLORSCALE, STATE_COLORS, hover_text, state_code

HEATMAP_COLUMNS = 64
MAX_TABLE_ROWS = 32
Decode = Callable[[tuple[int, ...]], str]


def _no_decode(token_ids: tuple[int, ...]) -> str:
    return " ".join(map(str, token_ids))


def _layout(figure: go.Figure, title: str, height: int) -> go.Figure:
    figure.update_layout(title=title, height=height, margin={"l": 50, "r": 20, "t": 60, "b": 30},
                         plot_bgcolor="white", uirevision="keep",  # keep zoom across ticks
                         legend={"orientation": "h", "y": -0.15})
    return figure


def _state_legend(figure: go.Figure) -> None:
    """Heatmaps have no per-category legend, so invisible points carry one."""
    for state, color in STATE_COLORS.items():
        figure.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=state,
                                    marker={"color": color, "size": 10, "symbol": "square"}))


def _block_hover(block: BlockInfo, decode: Decode) -> list:
    return [block.block_id, block.ref_count, block.state,
            ", ".join(block.owners[:4]) + (" …" if len(block.owners) > 4 else "") or "-",
            (block.block_hash or "-")[:12],
            hover_text(decode(block.token_ids)) if block.token_ids else "-"]


BLOCK_HOVER = ("block %{customdata[0]} · %{customdata[2]} · ref %{customdata[1]}<br>"
               "owners: %{customdata[3]}<br>hash: %{customdata[4]}<br>"
               "text: %{customdata[5]}<extra></extra>")


def pool_heatmap(snapshot: EngineSnapshot, decode: Decode = _no_decode) -> go.Figure:
    """Every physical block as one cell of a rows x 64 grid, coloured by state."""
    num_rows = -(-snapshot.num_blocks // HEATMAP_COLUMNS)
    z = [[None] * HEATMAP_COLUMNS for _ in range(num_rows)]
    custom = [[None] * HEATMAP_COLUMNS for _ in range(num_rows)]
    for block in snapshot.blocks:
        row, column = divmod(block.block_id, HEATMAP_COLUMNS)
        z[row][column] = state_code(block.state, block.ref_count)
        custom[row][column] = _block_hover(block, decode)
    figure = go.Figure(go.Heatmap(
        z=z, customdata=custom, hovertemplate=BLOCK_HOVER, colorscale=COLORSCALE,
        zmin=0, zmax=4, showscale=False, xgap=1, ygap=1, hoverongaps=False))
    _state_legend(figure)
    counts = {state: snapshot.count(state) for state in STATE_COLORS}
    figure.update_yaxes(autorange="reversed", title="block id // 64", showgrid=False)
    figure.update_xaxes(title="block id % 64", showgrid=False)
    title = (f"Block pool: {snapshot.num_blocks} blocks x {snapshot.block_size} tokens<br>"
             + " · ".join(f"{state} {count}" for state, count in counts.items()))
    return _layout(figure, title, height=200 + 16 * min(num_rows, 60))


def block_table_map(snapshot: EngineSnapshot, decode: Decode = _no_decode) -> go.Figure:
    """One row per sequence holding blocks: logical block index -> physical block id."""
    blocks = snapshot.blocks
    sequences = [seq for seq in snapshot.sequences if seq.block_table][:MAX_TABLE_ROWS]
    z, text, custom = [], [], []
    for seq in sequences:
        last = len(seq.block_table) - 1
        fill = seq.num_tokens - last * snapshot.block_size
        z.append([state_code(blocks[b].state, blocks[b].ref_count) for b in seq.block_table])
        text.append([str(b) if index < last else f"{b}·{min(fill, snapshot.block_size)}/"
                     f"{snapshot.block_size}" for index, b in enumerate(seq.block_table)])
        custom.append([_block_hover(blocks[b], decode) for b in seq.block_table])
    figure = go.Figure(go.Heatmap(
        z=z, text=text, texttemplate="%{text}", customdata=custom, colorscale=COLORSCALE,
        zmin=0, zmax=4, showscale=False, xgap=2, ygap=2, hovertemplate=BLOCK_HOVER,
        y=[f"{seq.seq_id} ({seq.status})" for seq in sequences], hoverongaps=False))
    _state_legend(figure)
    figure.update_yaxes(autorange="reversed", type="category")
    figure.update_xaxes(title="logical block (cell text: physical block id · last block fill)")
    title = f"Block tables of {len(sequences)} sequences"
    if not sequences:
        title += " (no request holds blocks right now)"
    return _layout(figure, title, height=160 + 26 * len(sequences))


def prefix_tree(snapshot: EngineSnapshot, decode: Decode = _no_decode) -> go.Figure:
    """The hash chain of every hashed block as an icicle: shared prefixes are trunks."""
    hashed = {block.block_hash: block for block in snapshot.blocks if block.block_hash}
    ids, labels, parents, values, colors, custom = ["root"], ["cache"], [""], [0], ["white"], [
        ["-", 0, "-", "-", "-", "-"]]
    for block_hash, block in hashed.items():
        ids.append(block_hash)
        # A child whose parent block was evicted still hangs off the root.
        parents.append(block.parent_hash if block.parent_hash in hashed else "root")
        labels.append(hover_text(decode(block.token_ids), limit=20))
        values.append(1 + block.ref_count)
        colors.append(STATE_COLORS[block.state])
        custom.append(_block_hover(block, decode))
    figure = go.Figure(go.Icicle(
        ids=ids, labels=labels, parents=parents, values=values, branchvalues="remainder",
        marker={"colors": colors}, customdata=custom, hovertemplate=BLOCK_HOVER,
        tiling={"orientation": "v"}, maxdepth=12))
    title = f"Prefix tree: {len(hashed)} hashed blocks (size = 1 + ref count)"
    if not hashed:
        title += " — nothing cached yet" + (
            "" if snapshot.config.get("enable_prefix_caching", True) else
            " (prefix caching is off)")
    return _layout(figure, title, height=420)


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

    @property
    def paged_useful(self) -> float:
        return self.paged_stored_tokens / self.paged_reserved_tokens if self.paged_reserved_tokens else 1.0

    @property
    def contiguous_useful(self) -> float:
        return (self.stored_tokens / self.contiguous_reserved_tokens
                if self.contiguous_reserved_tokens else 1.0)

    @property
    def contiguous_capacity(self) -> int:
        """Requests a contiguous allocator fits in the same pool."""
        return self.pool_tokens // self.max_model_len


def compare_memory(snapshot: EngineSnapshot) -> MemoryComparison:
    holders = [seq for seq in snapshot.sequences if seq.block_table]
    max_model_len = snapshot.config.get("max_model_len") or snapshot.block_size
    in_use = sum(1 for block in snapshot.blocks if block.ref_count > 0)
    return MemoryComparison(
        num_sequences=len(holders),
        stored_tokens=sum(seq.num_computed_tokens for seq in holders),
        paged_reserved_tokens=in_use * snapshot.block_size,
        paged_stored_tokens=snapshot.num_used_tokens,
        contiguous_reserved_tokens=len(holders) * max_model_len,
        pool_tokens=snapshot.num_blocks * snapshot.block_size,
        max_model_len=max_model_len)


def paged_vs_contiguous(snapshot: EngineSnapshot) -> go.Figure:
    """Stacked bars: useful KV rows against reserved-but-empty, for both allocators."""
    c = compare_memory(snapshot)
    rows = ["contiguous<br>(max_model_len each)", "paged (kvscope)"]
    useful = [c.stored_tokens, c.paged_stored_tokens]
    wasted = [c.contiguous_reserved_tokens - c.stored_tokens,
              c.paged_reserved_tokens - c.paged_stored_tokens]
    figure = go.Figure([
        go.Bar(y=rows, x=useful, name="tokens stored", orientation="h",
               marker_color=STATE_COLORS["used"]),
        go.Bar(y=rows, x=wasted, name="reserved, empty", orientation="h",
               marker_color="#fca5a5"),
    ])
    figure.add_vline(x=c.pool_tokens, line_dash="dot",
                     annotation_text=f"pool: {c.pool_tokens} tokens")
    figure.update_layout(barmode="stack")
    fits = min(c.num_sequences, c.contiguous_capacity)
    title = (f"Useful memory, {c.num_sequences} live sequences: paged {c.paged_useful:.0%}, "
             f"contiguous {c.contiguous_useful:.0%}<br>(published: 20.4–38.2%) · "
             f"contiguous fits {fits} of them (room for {c.contiguous_capacity})")
    return _layout(figure, title, height=300)
