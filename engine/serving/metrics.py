"""/metrics: the engine in Prometheus' text format, from its own registry per app."""

import asyncio
from collections.abc import Iterator

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from engine.async_engine import AsyncEngine
from engine.pool_mirror import PoolMirror, PoolReader

# vLLM's buckets, so dashboards built for it read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
LABELS = ["model_name"]
# As vLLM does: no `_created` series next to every counter and histogram (they double the
# output and no dashboard reads them).
disable_created_metrics()


class EngineMetrics:
    """A Prometheus collector over one AsyncEngine.

    Gauges come from a mirror of the pool kept from the engine's per-step deltas (a scrape
    never makes the engine thread copy the pool), counters from the engine's monotonic
    totals, histograms from the finished-request feed drained at each scrape.
    """

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.finished_requests = engine.subscribe_requests()
        # Not registered: collect() drains the feed into them first, then yields them.
        self.histograms = {
            name: Histogram(f"kvscope:{name}", doc, LABELS, buckets=buckets, registry=None)
            for name, doc, buckets in (
                ("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS),
                ("inter_token_latency_seconds", "Between consecutive output tokens.",
                 ITL_BUCKETS),
                ("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS),
                ("request_queue_time_seconds", "Arrival to first scheduling.",
                 LATENCY_BUCKETS))}
        self._pool = PoolReader(engine)
        self._snapshot: PoolMirror | None = None
        self._scrape_lock = asyncio.Lock()  # the mirror moves only between scrapes
        self.registry = CollectorRegistry()
        self.registry.register(self)

    async def render(self) -> bytes:
        async with self._scrape_lock:
            # A dead replica's pool feed ends: follow a live one so the gauges stay current.
            live = [status.replica for status in self.engine.replica_statuses() if status.alive]
            if live and self._pool.replica not in live:
                self._pool.focus(live[0])
            self._snapshot = await asyncio.to_thread(self._pool.update)
            return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        yield from self._gauges()
        yield from self._counters()
        yield from self._histograms()
        config = {name: str(value) for name, value in self.engine.config.to_dict().items()}
        config.update(self.engine.resolved_identity())  # what "auto" and None became
        config["num_blocks"] = str(self.engine.memory_plan.num_blocks)
        info = InfoMetricFamily("kvscope:engine_config", "The engine's resolved knobs.",
                                labels=LABELS)
        info.add_metric([self.model_name], config)
        yield info
        up = GaugeMetricFamily("kvscope:replica_up", "1 while the engine replica serves, 0 "
                               "when it is down (engine.replicas).",
                               labels=[*LABELS, "replica"])
        for status in self.engine.replica_statuses():
            up.add_metric([self.model_name, str(status.replica)], float(status.alive))
        yield up

    def _gauges(self) -> Iterator[Metric]:
        snapshot = self._snapshot
        if snapshot is None:
            return
        running = {seq.request_id for seq in snapshot.sequences if seq.status == "running"}
        waiting = {seq.request_id for seq in snapshot.sequences} - running
        used_blocks = snapshot.count("used") + snapshot.count("shared")
        token_slots = snapshot.num_blocks * snapshot.block_size
        for name, doc, value in (
            ("num_requests_running", "Requests with a sequence in the running batch.",
             len(running)),
            ("num_requests_waiting", "Requests waiting for their (re)admission.", len(waiting)),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
             used_blocks / snapshot.num_blocks),
            # Tokens stored over token slots: the gap to block usage is the free room in
            # partly filled last blocks, which block_size trades against.
            ("kv_cache_token_usage_perc", "Fraction of KV token slots holding a token (0-1).",
             snapshot.num_used_tokens / token_slots),
        ):
            gauge = GaugeMetricFamily(f"kvscope:{name}", doc, labels=LABELS)
            gauge.add_metric([self.model_name], value)
            yield gauge

    def _counters(self) -> Iterator[Metric]:
        totals = self.engine.counters()
        for name, doc, value in (
            ("prompt_tokens", "Prompt tokens of requests that got a first token.",
             totals.prompt_tokens),
            ("generation_tokens", "Generated tokens.", totals.generation_tokens),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             totals.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             totals.prefix_cache_hits),
            ("num_preemptions", "Sequences preempted.", totals.preemptions),
            ("step_failures", "Engine steps that raised.", totals.step_failures),
            ("engine_steps", "Engine steps run.", totals.num_steps),
        ):
            counter = CounterMetricFamily(f"kvscope:{name}", doc, labels=LABELS)
            counter.add_metric([self.model_name], value)
            yield counter
        swaps = CounterMetricFamily("kvscope:swaps", "Sequences swapped out to or in from "
                                    "CPU memory.", labels=[*LABELS, "direction"])
        swaps.add_metric([self.model_name, "out"], totals.swapped_out)
        swaps.add_metric([self.model_name, "in"], totals.swapped_in)
        yield swaps
        finished = CounterMetricFamily("kvscope:request_success", "Requests ended, by reason.",
                                       labels=[*LABELS, "finished_reason"])
        for reason, count in sorted(totals.requests_finished.items()):
            finished.add_metric([self.model_name, reason], count)
        yield finished

    def _histograms(self) -> Iterator[Metric]:
        histograms = {name: h.labels(self.model_name) for name, h in self.histograms.items()}
        for record in self.finished_requests.drain():
            metrics = record.output.metrics
            if metrics is None:
                continue
            if metrics.first_token_time is not None:
                histograms["time_to_first_token_seconds"].observe(
                    metrics.first_token_time - metrics.arrival_time)
            if metrics.first_scheduled_time is not None:
                histograms["request_queue_time_seconds"].observe(
                    metrics.first_scheduled_time - metrics.arrival_time)
            if metrics.finished_time is not None:
                histograms["e2e_request_latency_seconds"].observe(
                    metrics.finished_time - metrics.arrival_time)
            for latency in record.inter_token_latencies:
                histograms["inter_token_latency_seconds"].observe(latency)
        for histogram in self.histograms.values():
            yield from histogram.collect()


def metrics_router(metrics: EngineMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics")
    async def get_metrics() -> Response:
        return Response(await metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router
