"""kvscope's live KV events read as a vLLM router reads them: decoded with vLLM's own
vllm.distributed.kv_events.KVEventBatch, in vLLM's venv.

A random Gemma-3-shaped model (two sliding-window layers and a global one: three KV cache
groups, two of them sliding) serves prompts that share prefixes in a pool small enough to
evict, is reconfigured once (AllBlocksCleared) and serves again, publishing its KV events
over ZMQ. A subscriber started with --vllm-python decodes every batch it receives live
and, at the end, every batch the replay socket holds (a SUB misses what is sent before its
subscription arrives; the replay does not). Prints JSON: batches published, decoded live
and replayed, decode failures (the first few errors), events by type, and each group_idx's
kv_cache_spec fields as vLLM decoded them.

Usage (the vLLM peer's venv as docs/benchmarks.md gives it):
  python bench/kv_events_vllm.py --vllm-python /path/to/vllm-venv/bin/python
The subscriber is this file run with --subscribe by that interpreter; it imports vLLM,
never kvscope.
"""

import argparse
import json
import subprocess
import sys
import time
from collections import Counter


def subscribe(endpoint: str, replay_endpoint: str, topic: str) -> None:
    """In vLLM's venv: decode what arrives until a line on stdin says how many batches
    were published, then replay them all from 0; print the JSON report."""
    import msgspec
    import vllm
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    failures: list[str] = []
    live: dict[int, KVEventBatch] = {}

    def decode(seq: int, payload: bytes) -> KVEventBatch | None:
        try:
            return decoder.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError) as error:
            failures.append(f"batch {seq}: {error!r}")
            return None

    def receive(timeout_ms: int) -> bool:
        if not sub.poll(timeout_ms):
            return False
        _, seq, payload = sub.recv_multipart()
        seq = int.from_bytes(seq, "big")
        live[seq] = decode(seq, payload)
        return True

    print(json.dumps({"ready": True, "vllm": vllm.__version__}), flush=True)
    published = None
    while published is None:
        receive(50)
        if sys.stdin in _readable_stdin():
            published = int(sys.stdin.readline())
    while len(live) < published and receive(2_000):
        pass
    replay = context.socket(zmq.DEALER)
    replay.connect(replay_endpoint)
    replay.send_multipart((b"", (0).to_bytes(8, "big")))
    replayed: dict[int, KVEventBatch] = {}
    while True:
        if not replay.poll(10_000):
            failures.append("replay: no answer in 10 s")
            break
        _, _, seq, payload = replay.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            break
        seq = int.from_bytes(seq, "big")
        replayed[seq] = decode(seq, payload)
    events = [event for batch in replayed.values() if batch is not None
              for event in batch.events]
    groups = {}
    for event in events:
        if type(event).__name__ == "BlockStored":
            groups.setdefault(event.group_idx, Counter())[
                (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window)] += 1
    print(json.dumps({
        "vllm": vllm.__version__,
        "batches_published": published,
        "batches_decoded_live": sum(batch is not None for batch in live.values()),
        "batches_decoded_replayed": sum(batch is not None for batch in replayed.values()),
        "replay_covers_every_batch": sorted(replayed) == list(range(published)),
        "live_equals_replayed": all(replayed.get(seq) == batch for seq, batch in live.items()),
        "decode_failures": len(failures),
        "first_failures": failures[:5],
        "events": dict(Counter(type(event).__name__ for event in events)),
        "stored_by_group": {str(group): [{"kv_cache_spec_kind": kind,
                                          "kv_cache_spec_sliding_window": window,
                                          "block_stored_events": count}
                                         for (kind, window), count in kinds.items()]
                            for group, kinds in sorted(groups.items())},
    }), flush=True)


def _readable_stdin() -> list:
    import select

    return select.select([sys.stdin], [], [], 0)[0]


def serve(args: argparse.Namespace) -> None:
    """In kvscope's venv: the engine publishing, the subscriber in vLLM's."""
    import random
    import socket
    import tempfile
    from pathlib import Path

    from random_model import save_random_model
    from transformers import Gemma3TextConfig

    from kvscope.engine.config import EngineConfig
    from kvscope.engine.orchestrator.async_engine import AsyncEngine
    from kvscope.engine.sampling_params import SamplingParams
    from kvscope.engine.telemetry.kv_event_publisher import KVEventsConfig, publish_kv_events

    def free_port() -> int:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]

    port, replay_port, topic = free_port(), free_port(), "kv-events"
    with tempfile.TemporaryDirectory() as folder:
        model = save_random_model(Path(folder), Gemma3TextConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
            pad_token_id=None))
        engine = AsyncEngine.from_config(EngineConfig(
            model=str(model), dtype="float32", device="cpu", block_size=args.block_size,
            num_gpu_blocks_override=args.num_blocks, max_model_len=64))
        publisher = publish_kv_events(engine, KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}",
            replay_endpoint=f"tcp://*:{replay_port}", topic=topic))
        engine.start()
        subscriber = subprocess.Popen(
            [args.vllm_python, __file__, "--subscribe", f"tcp://127.0.0.1:{port}",
             "--replay", f"tcp://127.0.0.1:{replay_port}", "--topic", topic],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            ready = json.loads(subscriber.stdout.readline())
            rng = random.Random(0)
            prefixes = [[rng.randrange(256) for _ in range(3 * args.block_size)]
                        for _ in range(4)]

            def traffic() -> None:
                streams = [engine.submit(rng.choice(prefixes) + [rng.randrange(256) for _ in
                                                                 range(rng.randrange(1, 20))],
                                         SamplingParams(max_tokens=4, ignore_eos=True))
                           for _ in range(args.prompts)]
                for stream in streams:
                    for _ in stream:
                        pass

            traffic()
            engine.reconfigure(block_size=args.block_size * 2)
            traffic()
            published = -1
            while published != publisher.num_batches:  # the publisher sends at its own pace
                published = publisher.num_batches
                time.sleep(0.5)
            subscriber.stdin.write(f"{published}\n")
            subscriber.stdin.flush()
            report = json.loads(subscriber.stdout.readline())
        finally:
            subscriber.stdin.close()
            subscriber.wait(timeout=60)
            engine.shutdown()
            publisher.shutdown()
    print(json.dumps({"model": "random Gemma 3 text, layers sliding 8, sliding 8, global",
                      "kv_cache_group_windows": list(engine.memory_plan.group_windows),
                      "subscriber": ready, **report}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", help="the vLLM venv's python (serve mode)")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=96)
    parser.add_argument("--subscribe", metavar="ENDPOINT", help=argparse.SUPPRESS)
    parser.add_argument("--replay", metavar="ENDPOINT", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.subscribe:
        subscribe(args.subscribe, args.replay, args.topic)
    elif args.vllm_python:
        serve(args)
    else:
        parser.error("--vllm-python: give the vLLM venv's python")


if __name__ == "__main__":
    main()
