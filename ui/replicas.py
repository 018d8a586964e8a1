"""The Replicas tab (engine.replicas.ReplicaSet only): one small pool heatmap per replica
with its hit rate and load, the recent routing decisions and the routing knobs (the Live
tab has its own replica selector, per browser tab)."""

import threading

import gradio as gr

from kvscope.engine.entrypoints.view import EngineView
from kvscope.engine.replicas.router import ROUTING_POLICIES
from kvscope.engine.telemetry.pool_mirror import PoolReader
from kvscope.ui import figures
from kvscope.ui.plotdata import panel, placeholder, to_plot

REFRESH_S = 2.0
SHOWN_DECISIONS = 20
DECISION_COLUMNS = ["request", "policy", "replica", "matched blocks", "candidates (score, matched)"]


class ReplicaOverview:
    """A PoolReader per replica (the same per-step pool deltas the Live tab reads)."""

    def __init__(self, engine: EngineView) -> None:
        self.engine = engine
        self.pools = [PoolReader(engine, replica) for replica in range(engine.num_replicas)]
        self._lock = threading.Lock()

    def refresh(self) -> list:
        with self._lock:
            statuses = self.engine.replica_statuses()
            heatmaps = []
            for follower, status in zip(self.pools, statuses, strict=True):
                title = f"replica {status.replica}"
                if not status.alive:
                    heatmaps.append(to_plot(placeholder(title, f"down: {status.error}")))
                    continue
                pool = follower.update(0.0)
                heatmaps.append(to_plot(figures.pool_heatmap(pool) if pool.ready else
                                        placeholder(title, "waiting for the pool")))
        return [overview_markdown(self.engine, statuses), decision_rows(self.engine), *heatmaps]


def overview_markdown(engine: EngineView, statuses) -> str:
    lines = [f"**{engine.num_replicas} replicas** · routing **{engine.routing}** (load weight "
             f"{engine.routing_load_weight:g}) · {sum(s.alive for s in statuses)} up", "",
             "| replica | state | in flight | KV usage | prefix hit rate | indexed blocks | "
             "restarts |", "|---|---|---|---|---|---|---|"]
    for s in statuses:
        counters = s.counters
        hit_rate = (f"{counters.prefix_cache_hits / counters.prefix_cache_queries:.0%}"
                    if counters.prefix_cache_queries else "–")
        state = "up" if s.alive else f"**down** ({s.error})"
        lines.append(f"| {s.replica} | {state} | {s.in_flight} | {s.kv_usage:.0%} | "
                     f"{hit_rate} | {s.num_indexed_blocks} | {s.restarts} |")
    return "\n".join(lines)


def decision_rows(engine: EngineView) -> list[list]:
    rows = []
    for decision in reversed(list(engine.recent_decisions)[-SHOWN_DECISIONS:]):
        candidates = ", ".join(f"r{c.replica}: {c.score:+.2f} ({c.matched_blocks})"
                               for c in decision.candidates)
        rows.append([decision.request_id, decision.policy, decision.replica,
                     f"{decision.matched_blocks}/{decision.num_prompt_blocks}", candidates])
    return rows


def set_routing(engine: EngineView, policy: str, load_weight: float) -> str:
    try:
        engine.set_routing(policy, load_weight)
    except ValueError as error:
        gr.Warning(str(error))
        return f"**Not changed:** {error}"
    return f"Routing: **{engine.routing}**, load weight {engine.routing_load_weight:g}"


def replicas_tab(engine: EngineView) -> None:
    overview = ReplicaOverview(engine)
    summary = gr.Markdown(elem_id="kv-replicas-summary")
    with gr.Row():
        heatmaps = [panel(f"replica {replica} pool", f"kv-replica-{replica}")
                    for replica in range(engine.num_replicas)]
    with gr.Row():
        policy = gr.Radio(list(ROUTING_POLICIES), value=engine.routing, label="routing",
                          elem_id="kv-routing")
        weight = gr.Number(engine.routing_load_weight, minimum=0, label="kv-aware load weight")
        apply = gr.Button("Apply routing", elem_id="kv-routing-apply")
    status = gr.Markdown(elem_id="kv-replicas-status")
    decisions = gr.Dataframe(headers=DECISION_COLUMNS, interactive=False,
                             label="Recent routing decisions (newest first)",
                             elem_id="kv-routing-decisions")
    apply.click(lambda p, w: set_routing(engine, p, w), [policy, weight], status,
                api_name="set_routing")
    outputs = [summary, decisions, *heatmaps]
    gr.Timer(REFRESH_S).tick(overview.refresh, None, outputs, show_progress="hidden",
                             api_name="refresh_replicas", trigger_mode="always_last")
