"""The timer's handler: every live panel, skipping those whose data did not change."""

import gradio as gr

from engine.telemetry import EngineSnapshot
from ui import figures, timeline
from ui.live import LiveFeed, LiveState

PANELS = ("summary", "heatmap", "block_tables", "prefix_tree", "timeline", "series", "stats",
          "comparison")


def _pool_signature(snapshot: EngineSnapshot) -> tuple:
    return (snapshot.num_blocks, snapshot.block_size,
            tuple((b.ref_count, b.state, b.block_hash, len(b.token_ids), b.owners)
                  for b in snapshot.blocks))


def _signatures(state: LiveState) -> dict[str, object]:
    snapshot = state.snapshot
    pool = hash(_pool_signature(snapshot))
    sequences = hash(tuple((s.seq_id, s.status, s.block_table, s.num_tokens)
                           for s in snapshot.sequences))
    last_step = state.records[-1].step if state.records else -1
    return {
        "summary": (snapshot.num_blocks, snapshot.block_size, snapshot.num_running,
                    snapshot.num_waiting, hash(str(snapshot.config))),
        "heatmap": pool,
        "block_tables": (pool, sequences),
        "prefix_tree": pool,
        "timeline": (last_step, len(state.arrivals)),
        "series": (last_step, snapshot.num_used_tokens),
        "stats": (last_step, snapshot.prefix_cache_hits, snapshot.num_preemptions),
        "comparison": (pool, sequences),
    }


def summary_markdown(snapshot: EngineSnapshot) -> str:
    config = snapshot.config
    max_model_len = config.get("max_model_len") or 0
    per_sequence = -(-max_model_len // snapshot.block_size) if max_model_len else 0
    concurrency = snapshot.num_blocks / per_sequence if per_sequence else 0
    return (f"**pool** {snapshot.num_blocks} blocks x {snapshot.block_size} tokens = "
            f"{snapshot.num_blocks * snapshot.block_size} token slots · **max concurrency** "
            f"{concurrency:.1f} x {max_model_len} tokens · **running** {snapshot.num_running}"
            f" · **waiting** {snapshot.num_waiting} · prefix caching "
            f"{'on' if config.get('enable_prefix_caching') else 'off'} · chunked prefill "
            f"{'on' if config.get('enable_chunked_prefill') else 'off'}")


def _render(name: str, state: LiveState, decode):
    snapshot = state.snapshot
    if name == "summary":
        return summary_markdown(snapshot)
    if name == "heatmap":
        return figures.pool_heatmap(snapshot, decode)
    if name == "block_tables":
        return figures.block_table_map(snapshot, decode)
    if name == "prefix_tree":
        return figures.prefix_tree(snapshot, decode)
    if name == "timeline":
        return timeline.request_timeline(state.records, state.arrivals)
    if name == "series":
        return timeline.pool_series(state.records, snapshot.num_blocks, state.token_usage)
    if name == "stats":
        queries = snapshot.prefix_cache_queries
        return timeline.stats_markdown(
            timeline.latency_stats(state.records, state.arrivals),
            snapshot.prefix_cache_hits / queries if queries else None,
            snapshot.num_preemptions)
    return figures.paged_vs_contiguous(snapshot)


def refresh_panels(feed: LiveFeed, shown: dict | None):
    """One value per panel in PANELS order (gr.skip() if unchanged), then the new
    signatures; `shown` is this browser tab's state, so each tab gets full panels once."""
    state = feed.refresh()
    signatures = _signatures(state)
    shown = shown or {}
    values = [gr.skip() if shown.get(name) == signatures[name]
              else _render(name, state, feed.decode) for name in PANELS]
    return *values, signatures
