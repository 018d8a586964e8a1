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
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from kvscope.engine.core.kv_events import PreemptionReason
from kvscope.engine.entrypoints.view import EngineView
from kvscope.engine.orchestrator.async_engine import ReplicaStatus, RequestRecord
from kvscope.engine.telemetry.pool_mirror import PoolMirror, PoolReader

# vLLM's buckets, so dashboards built for it read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's names and labels (engine: the replica, "0" for a single engine) for everything
# kvscope measures with vLLM's meaning, so dashboards built for vLLM read kvscope as is;
# the `kvscope:` series are what vLLM lacks, labelled by replica.
VLLM_LABELS = ["model_name", "engine"]
LABELS = ["model_name", "replica"]
GAUGES = (  # (series, help)
    ("vllm:num_requests_running", "Requests with a sequence in the running batch."),
    ("vllm:num_requests_waiting", "Requests waiting for their (re)admission."),
    ("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)."),
    # Tokens stored over token slots: the gap to block usage is the free room in partly
    # filled last blocks, which block_size trades against.
    ("kvscope:kv_cache_token_usage_perc", "Fraction of KV token slots holding a token (0-1)."),
)
COUNTERS = (  # (series, EngineCounters field, help)
    ("vllm:prompt_tokens", "prompt_tokens", "Prompt tokens of requests that got a first token."),
    ("vllm:generation_tokens", "generation_tokens", "Generated tokens."),
    ("vllm:prefix_cache_queries", "prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache."),
    ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("vllm:external_prefix_cache_queries", "external_prefix_cache_queries",
     "Prompt tokens past the pool's prefix looked up in the disk tier (--kv-offload-dir)."),
    ("vllm:external_prefix_cache_hits", "external_prefix_cache_hits",
     "Prompt tokens loaded from the disk tier instead of computed."),
    ("kvscope:step_failures", "step_failures", "Engine steps that raised."),
    ("kvscope:engine_steps", "num_steps", "Engine steps run."),
    ("vllm:spec_decode_num_drafts", "spec_decode_num_drafts",
     "Speculative proposals verified (one per sequence per verifying step)."),
    ("vllm:spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens",
     "Tokens proposed and verified."),
    ("vllm:spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
     "Proposed tokens that verification accepted."),
    ("kvscope:moe_expert_bytes_read", "moe_expert_bytes_read",
     "Bytes of expert weights the steps read: each step, every expert its tokens chose, "
     "once (0 for a dense model)."),
    ("kvscope:moe_expert_bytes_all", "moe_expert_bytes_all",
     "Bytes all experts hold, once per step: what a dense model of the same size reads "
     "of them (0 for a dense model)."),
)
TIME_HISTOGRAMS = (  # (series, help, buckets)
    ("vllm:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS),
    ("vllm:inter_token_latency_seconds", "Between consecutive output tokens.", ITL_BUCKETS),
    ("vllm:e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS),
    ("vllm:request_queue_time_seconds", "Arrival to first scheduling.", LATENCY_BUCKETS),
    ("vllm:request_prefill_time_seconds", "First scheduling to first token.", LATENCY_BUCKETS),
    ("vllm:request_decode_time_seconds", "First token to finish.", LATENCY_BUCKETS),
    ("vllm:request_inference_time_seconds", "First scheduling to finish.", LATENCY_BUCKETS),
)
TOKEN_HISTOGRAMS = (("vllm:request_prompt_tokens", "Prompt tokens per finished request."),
                    ("vllm:request_generation_tokens",
                     "Generated tokens per finished request (all its samples)."),
                    ("vllm:request_max_num_generation_tokens",
                     "The longest sample's generated tokens per finished request."))
# vLLM's cache_config_info labels that kvscope has.
CACHE_CONFIG_KNOBS = ("block_size", "enable_prefix_caching", "gpu_memory_utilization",
                      "swap_space")


def labels_of(name: str) -> list[str]:
    return VLLM_LABELS if name.startswith("vllm:") else LABELS


def one_two_five_buckets(limit: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50... up to `limit`."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(buckets)
            buckets.append(step * scale)
        scale *= 10


# As vLLM does: no `_created` series next to every counter and histogram (they double the
# output and no dashboard reads them).
disable_created_metrics()


class EngineMetrics:
    """A Prometheus collector over an AsyncEngine or a ReplicaSet, one series per replica.

    Gauges come from a mirror of each live replica's pool kept from its per-step deltas (a
    scrape never makes an engine thread copy its pool), counters from each replica's
    monotonic totals, histograms from the finished-request feed (each record names its
    replica). The app's lifespan runs `observe_finished`, which observes each record as it
    arrives, so neither the records nor their outputs wait for a scrape that may never
    come; a scrape observes whatever is still queued (an app served without a lifespan).
    """

    def __init__(self, engine: EngineView, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.finished_requests = engine.subscribe_requests()
        # Not registered: yielded by collect().
        token_buckets = one_two_five_buckets(engine.config.max_model_len or 1)
        self.histograms = {
            name: Histogram(name, doc, VLLM_LABELS, buckets=buckets, registry=None)
            for name, doc, buckets in (
                *TIME_HISTOGRAMS,
                *((name, doc, token_buckets) for name, doc in TOKEN_HISTOGRAMS))}
        self._pools = [PoolReader(engine, replica) for replica in range(engine.num_replicas)]
        self._mirrors: list[tuple[int, PoolMirror]] = []  # (replica, its pool)
        self._statuses: list[ReplicaStatus] = []
        self._scrape_lock = asyncio.Lock()  # the mirror moves only between scrapes
        self.registry = CollectorRegistry()
        self.registry.register(self)

    async def observe_finished(self) -> None:
        """Observe each finished request as it comes, until the feed closes (`close`)."""
        async for record in self.finished_requests:
            self._observe(record)

    def close(self) -> None:
        """Unsubscribe from the engine (the app stops)."""
        self.finished_requests.close()

    async def render(self) -> bytes:
        async with self._scrape_lock:
            self._statuses = self.engine.replica_statuses()
            # A dead replica's pool feed is silent (waiting on it would stall the scrape):
            # it has no gauges until it serves again.
            live = [self._pools[status.replica] for status in self._statuses if status.alive]
            mirrors = await asyncio.gather(*(asyncio.to_thread(pool.update) for pool in live))
            self._mirrors = [(pool.replica, mirror) for pool, mirror in zip(live, mirrors, strict=True)
                             if mirror.ready]
            return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        yield from self._gauges()
        yield from self._counters()
        yield from self._histograms()
        config = {name: str(value) for name, value in self.engine.config.to_dict().items()}
        config.update(self.engine.resolved_identity())  # what "auto" and None became
        config["num_blocks"] = str(self.engine.memory_plan.num_blocks)
        # Every replica runs the same config: one series, labelled by model only.
        info = InfoMetricFamily("kvscope:engine_config", "The engine's resolved knobs.",
                                labels=["model_name"])
        info.add_metric([self.model_name], config)
        yield info
        cache = InfoMetricFamily("vllm:cache_config", "The KV cache's configuration.",
                                 labels=["engine"])
        for status in self._statuses:
            cache.add_metric([str(status.replica)], {
                **{knob: config[knob] for knob in CACHE_CONFIG_KNOBS},
                "num_gpu_blocks": config["num_blocks"]})
        yield cache
        up = GaugeMetricFamily("kvscope:replica_up", "1 while the engine replica serves, 0 "
                               "when it is down (engine.replicas).",
                               labels=LABELS)
        for status in self._statuses:
            up.add_metric([self.model_name, str(status.replica)], float(status.alive))
        yield up

    def _gauges(self) -> Iterator[Metric]:
        gauges = {name: GaugeMetricFamily(name, doc, labels=labels_of(name))
                  for name, doc in GAUGES}
        for replica, pool in self._mirrors:
            running, waiting = pool.request_counts()
            used_blocks = pool.count("used") + pool.count("shared")
            labels = [self.model_name, str(replica)]
            gauges["vllm:num_requests_running"].add_metric(labels, running)
            gauges["vllm:num_requests_waiting"].add_metric(labels, waiting)
            gauges["vllm:kv_cache_usage_perc"].add_metric(labels, used_blocks / pool.num_blocks)
            gauges["kvscope:kv_cache_token_usage_perc"].add_metric(
                labels, pool.num_used_tokens / (pool.num_blocks * pool.block_size))
        yield from gauges.values()

    def _counters(self) -> Iterator[Metric]:
        counters = {name: CounterMetricFamily(name, doc, labels=labels_of(name))
                    for name, _, doc in COUNTERS}
        # Every reason, 0 or not, so the sum over `reason` is vLLM's unlabelled total (what
        # vLLM's dashboards plot: sum(increase(vllm:num_preemptions_total[...]))).
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Sequences preempted, by "
                                          "reason (kv_full, priority, max_num_seqs).",
                                          labels=[*VLLM_LABELS, "reason"])
        swaps = CounterMetricFamily("kvscope:swaps", "Sequences swapped out to or in from "
                                    "CPU memory.", labels=[*LABELS, "direction"])
        finished = CounterMetricFamily("vllm:request_success", "Requests ended, by reason.",
                                       labels=[*VLLM_LABELS, "finished_reason"])
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Proposed tokens accepted, by position in the proposal "
                                      "(0 first).", labels=[*VLLM_LABELS, "position"])
        offload_bytes = CounterMetricFamily("vllm:kv_offload_total_bytes", "Bytes the disk "
                                            "tier moved, by transfer type (GPU: the pool).",
                                            labels=[*VLLM_LABELS, "transfer_type"])
        offload_time = CounterMetricFamily("vllm:kv_offload_total_time", "Seconds the disk "
                                           "tier's I/O thread spent moving them.",
                                           labels=[*VLLM_LABELS, "transfer_type"])
        offload_sizes = HistogramMetricFamily("vllm:kv_offload_size", "The disk tier's "
                                              "transfers by size in bytes (GPU_to_DISK: a "
                                              "block written; DISK_to_GPU: a prefix loaded).",
                                              labels=[*VLLM_LABELS, "transfer_type"])
        experts = CounterMetricFamily("kvscope:moe_expert_tokens", "Tokens each expert of a "
                                      "mixture-of-experts layer took (a token counts once in "
                                      "each of its top-k experts), by decoder layer.",
                                      labels=[*LABELS, "layer", "expert"])
        for status in self._statuses:  # a dead replica keeps its last totals (monotonic)
            totals, labels = status.counters, [self.model_name, str(status.replica)]
            for name, field, _ in COUNTERS:
                counters[name].add_metric(labels, getattr(totals, field))
            for reason in PreemptionReason:
                preemptions.add_metric([*labels, reason.value],
                                       totals.preemptions_by_reason.get(reason.value, 0))
            swaps.add_metric([*labels, "out"], totals.swapped_out)
            swaps.add_metric([*labels, "in"], totals.swapped_in)
            for reason, count in sorted(totals.requests_finished.items()):
                finished.add_metric([*labels, reason], count)
            for kind, count in sorted(totals.kv_offload_bytes.items()):
                offload_bytes.add_metric([*labels, kind], count)
                offload_time.add_metric([*labels, kind], totals.kv_offload_seconds[kind])
            for kind, sizes in sorted(totals.kv_offload_sizes.items()):
                offload_sizes.add_metric([*labels, kind], [
                    (floatToGoString(bound), count) for bound, count in sizes.cumulative()],
                    sizes.num_bytes)
            for position, count in sorted(totals.spec_decode_num_accepted_tokens_per_pos.items()):
                per_pos.add_metric([*labels, str(position)], count)
            for layer, tokens in sorted(totals.moe_expert_tokens.items()):
                for expert, count in enumerate(tokens.tolist()):
                    experts.add_metric([*labels, str(layer), str(expert)], count)
        yield from counters.values()
        yield preemptions
        yield swaps
        yield finished
        yield per_pos
        yield offload_bytes
        yield offload_time
        yield offload_sizes
        yield experts

    def _histograms(self) -> Iterator[Metric]:
        for record in self.finished_requests.drain():
            self._observe(record)
        for histogram in self.histograms.values():
            yield from histogram.collect()

    def _observe(self, record: RequestRecord) -> None:
        metrics = record.output.metrics
        if metrics is None:
            return
        labels = (self.model_name, str(record.replica))
        arrival, scheduled = metrics.arrival_time, metrics.first_scheduled_time
        first_token, finished = metrics.first_token_time, metrics.finished_time
        for name, start, end in (
                ("vllm:time_to_first_token_seconds", arrival, first_token),
                ("vllm:request_queue_time_seconds", arrival, scheduled),
                ("vllm:e2e_request_latency_seconds", arrival, finished),
                ("vllm:request_prefill_time_seconds", scheduled, first_token),
                ("vllm:request_decode_time_seconds", first_token, finished),
                ("vllm:request_inference_time_seconds", scheduled, finished)):
            if start is not None and end is not None:
                self._histogram(name, labels).observe(end - start)
        for latency in record.inter_token_latencies:
            self._histogram("vllm:inter_token_latency_seconds", labels).observe(latency)
        output = record.output
        self._histogram("vllm:request_prompt_tokens", labels).observe(
            len(output.prompt_token_ids or ()))
        lengths = [len(sample.token_ids) for sample in output.outputs]
        self._histogram("vllm:request_generation_tokens", labels).observe(sum(lengths))
        self._histogram("vllm:request_max_num_generation_tokens", labels).observe(
            max(lengths, default=0))

    def _histogram(self, name: str, labels: tuple[str, str]):
        return self.histograms[name].labels(*labels)


def metrics_router(metrics: EngineMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics")
    async def get_metrics() -> Response:
        return Response(await metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router
