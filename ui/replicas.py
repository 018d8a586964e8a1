"""The Replicas tab (engine.replicas.ReplicaSet only): one small pool heatmap per replica
with its hit rate and load, the recent routing decisions, the router's belief against the
replicas' caches (its index, how stale, its predicted hits against the actual ones) and
the routing knobs (the Live tab has its own replica selector, per browser tab)."""

import threading

import gradio as gr

from kvscope.engine.entrypoints.view import EngineView
from kvscope.engine.replicas.hit_outcomes import HitOutcome, HitTotals
from kvscope.engine.replicas.router import ROUTING_POLICIES
from kvscope.engine.replicas.router_view import RouterView
from kvscope.engine.telemetry.pool_mirror import PoolReader
from kvscope.ui import figures
from kvscope.ui.plotdata import panel, placeholder, to_plot

REFRESH_S = 2.0
SHOWN_DECISIONS = 20
DECISION_COLUMNS = ["request", "policy", "replica", "matched blocks", "candidates (score, matched)"]
SHOWN_MISSES = 20
MISS_COLUMNS = ["request", "replica", "prompt tokens", "predicted hit", "actual hit", "why"]
UNFORESEEN = "a hit the index did not know"


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


def belief_markdown(view: RouterView) -> str:
    """The router's counters, the recent outcomes' sums, and per live replica its index
    beside its prefix cache."""
    totals = view.totals
    recent = settled_totals(view.outcomes)
    reasons = ", ".join(f"{reason} {count}" for reason, count in
                        sorted(totals.misses_by_reason.items())) or "none"
    lines = [
        f"**Predicted against actual prefix hits** (tokens, {totals.requests} requests "
        f"settled): predicted **{totals.predicted_tokens}**, actual "
        f"**{totals.actual_tokens}**, missed {totals.missed_tokens}, unforeseen "
        f"{totals.unforeseen_tokens} · misses {totals.misses} ({reasons})",
        f"Over the last {recent.requests} settled (the table's source): predicted "
        f"{recent.predicted_tokens}, actual {recent.actual_tokens}", "",
        "| replica | index believes (blocks) | routed guesses | cached | believed, evicted | "
        "cached, unknown | index age | events behind |", "|---|---|---|---|---|---|---|---|"]
    for c in view.replicas:
        age = "–" if c.age_s is None else f"{c.age_s:.1f} s"
        behind = "–" if c.events_behind is None else str(c.events_behind)
        lines.append(f"| {c.replica} | {c.believed_blocks} | {c.guessed_blocks} | "
                     f"{c.cached_blocks} | {c.believed_but_evicted} | {c.cached_but_unknown} "
                     f"| {age} | {behind} |")
    return "\n".join(lines)


def settled_totals(outcomes: tuple[HitOutcome, ...]) -> HitTotals:
    totals = HitTotals()
    for outcome in outcomes:
        if outcome.actual_tokens is not None:
            totals.add(outcome)
    return totals


def miss_rows(view: RouterView) -> list[list]:
    """The latest settled requests whose hit differed from the prediction, newest first."""
    rows = []
    for outcome in reversed(view.outcomes):
        if outcome.actual_tokens is None or outcome.actual_tokens == outcome.predicted_tokens:
            continue
        why = outcome.reason.value if outcome.reason is not None else UNFORESEEN
        rows.append([outcome.request_id, outcome.replica, outcome.num_prompt_tokens,
                     outcome.predicted_tokens, outcome.actual_tokens, why])
        if len(rows) == SHOWN_MISSES:
            break
    return rows


def refresh_belief(engine: EngineView) -> list:
    try:
        view = engine.router_view()
    except TimeoutError:
        return ["The replicas did not answer in time; retrying.", []]
    return [belief_markdown(view), miss_rows(view)]


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
    belief = gr.Markdown(elem_id="kv-router-belief")
    misses = gr.Dataframe(headers=MISS_COLUMNS, interactive=False,
                          label="Requests whose prefix hit differed from the router's "
                                "prediction (newest first)", elem_id="kv-router-misses")
    apply.click(lambda p, w: set_routing(engine, p, w), [policy, weight], status,
                api_name="set_routing")
    outputs = [summary, decisions, *heatmaps]
    timer = gr.Timer(REFRESH_S)
    timer.tick(overview.refresh, None, outputs, show_progress="hidden",
               api_name="refresh_replicas", trigger_mode="always_last")
    timer.tick(lambda: refresh_belief(engine), None, [belief, misses], show_progress="hidden",
               api_name="refresh_router", trigger_mode="always_last")
