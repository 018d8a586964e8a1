"""The disk tier below the KV pool (engine/core/kv_offload): evicted prefixes are served
from it, warm restarts find it, and nothing torn, corrupt or foreign is ever served."""

import dataclasses
import json
import logging
import math
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import make_sequence, serve
from prometheus_client.parser import text_string_to_metric_families

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.kv_cache_manager import KVCacheManager
from kvscope.engine.core.kv_events import TierBlockStored
from kvscope.engine.core.kv_offload.block_file import HEADER, SUFFIX
from kvscope.engine.core.kv_offload.disk_store import DiskStore
from kvscope.engine.core.kv_offload.transfer_sizes import SIZE_BUCKETS, TransferSizes
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.serving import create_app
from kvscope.engine.telemetry.kv_event_wire import MEDIUM_GPU, wire_events
from kvscope.engine.telemetry.kv_event_wire import BlockRemoved as WireBlockRemoved
from kvscope.engine.telemetry.kv_event_wire import BlockStored as WireBlockStored
from kvscope.engine.telemetry.records import TIER_STEP_FIELDS
from kvscope.storage import SessionLog, export_session, load_session, open_database
from kvscope.ui.tiers import session_tier_markdown

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BLOCK = 4
# A pool of 16 blocks of 4 tokens: one 26-token prompt holds 7, so the two others evict it.
POOL = {"block_size": BLOCK, "num_gpu_blocks_override": 16, "max_num_seqs": 1,
        "max_model_len": 64}


def random_prompt(seed: int, length: int = 26) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 200) for _ in range(length)]


PREFIX = random_prompt(0)
OTHERS = [random_prompt(1), random_prompt(2)]


def tier_engine(make_engine, folder: Path, **knobs):
    return make_engine("llama", **{**POOL, **knobs}, kv_offload_dir=str(folder),
                       kv_offload_gb=0.01)


def block_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"*/*{SUFFIX}"))


def evict_and_return(engine, run_engine):
    """The prefix, two other prompts that push it out of the pool, the prefix again (its
    output, the prefix misses its admission reported, and the other prompts' ids)."""
    first = run_engine(engine, [PREFIX], GREEDY).outputs[0]
    others = run_engine(engine, OTHERS, GREEDY).outputs
    again = run_engine(engine, [PREFIX], GREEDY)
    return (first, again.outputs[0], [miss for r in again.records for miss in r.prefix_misses],
            {output.request_id for output in others})


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_evicted_prefix_is_loaded_from_the_tier_with_identical_outputs(
        make_engine, run_engine, tmp_path, async_scheduling):
    plain = make_engine("llama", **POOL)
    expected, recomputed, plain_misses, others = evict_and_return(plain, run_engine)
    engine = tier_engine(make_engine, tmp_path, async_scheduling=async_scheduling)
    first, again, misses, _ = evict_and_return(engine, run_engine)
    stats = engine.kv_tier.stats
    assert first.outputs[0].token_ids == again.outputs[0].token_ids \
        == expected.outputs[0].token_ids
    # Without the tier most of the prefix was evicted and recomputed; with it, every full
    # block but the last token's was reused, those the pool lost loaded from the tier.
    full_blocks = (len(PREFIX) - 1) // BLOCK
    assert recomputed.num_cached_tokens < full_blocks * BLOCK
    assert again.num_cached_tokens == full_blocks * BLOCK
    assert stats.hits == full_blocks * BLOCK - recomputed.num_cached_tokens
    assert stats.blocks_loaded * BLOCK == stats.hits and stats.bytes_loaded > 0
    # Without the tier the miss says who evicted the prefix; the blocks the tier loaded
    # back are hits, so with it only the prompt's partial last block is left unhit (the
    # first run filled and cached that block; its last token is computed anyway).
    (miss,) = plain_misses
    assert miss[1:3] == ("evicted", full_blocks * BLOCK - recomputed.num_cached_tokens)
    assert miss[3] in others
    assert [miss[1:] for miss in misses] == [
        ("partial_block", len(PREFIX) - 1 - full_blocks * BLOCK, None, None)]
    engine.close()


def test_kv_events_carry_the_disk_medium(make_engine, run_engine, tmp_path):
    engine = tier_engine(make_engine, tmp_path)
    events = []
    engine.events.subscribe(events.append)
    evict_and_return(engine, run_engine)
    engine.close()
    stored = [event for event in events if isinstance(event, TierBlockStored)]
    prefix = {block_hash[0] for block_hash in _prefix_hashes()}
    assert prefix <= {event.block_hash[0] for event in stored}
    wire = wire_events(events, MEDIUM_GPU, engine.runner.group_windows)
    mediums = {(type(event).__name__, event.medium) for event in wire
               if isinstance(event, (WireBlockStored, WireBlockRemoved))}
    assert {("BlockStored", "DISK"), ("BlockStored", "GPU"), ("BlockRemoved", "GPU")} <= mediums
    disk_hashes = {h for event in wire if isinstance(event, WireBlockStored)
                   and event.medium == "DISK" for h in event.block_hashes}
    assert prefix <= disk_hashes


def test_the_served_engine_exports_the_tiers_series_under_vllms_names(tiny_model, tmp_path):
    config = EngineConfig(model=str(tiny_model("llama").path), dtype="float32", device="cpu",
                          **POOL, kv_offload_dir=str(tmp_path), kv_offload_gb=0.01)
    engine = AsyncEngine.from_config(config).start()
    url, server, thread = serve(create_app(engine))
    try:
        for prompt in (PREFIX, *OTHERS, PREFIX):
            list(engine.submit(prompt, GREEDY))
        # A reconfigured engine's new pool starts empty; the tier kept what the old one had.
        engine.reconfigure(max_num_seqs=2, timeout=60)
        list(engine.submit(OTHERS[0], GREEDY))
        scraped = [sample for family in text_string_to_metric_families(
            httpx.get(f"{url}/metrics").text) for sample in family.samples]
        counters = engine.counters()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()
    samples = {(sample.name, sample.labels.get("transfer_type")): sample.value
               for sample in scraped if "le" not in sample.labels}
    hits = samples[("vllm:external_prefix_cache_hits_total", None)]
    assert hits > (len(OTHERS[0]) - 1) // BLOCK * BLOCK and hits % BLOCK == 0
    assert samples[("vllm:external_prefix_cache_queries_total", None)] >= hits
    assert samples[("vllm:kv_offload_total_bytes_total", "DISK_to_GPU")] > 0
    assert samples[("vllm:kv_offload_total_time_total", "DISK_to_GPU")] > 0
    assert ("vllm:kv_offload_total_bytes_total", "GPU_to_DISK") in samples
    # vllm:kv_offload_size, vLLM's histogram: one observation per load and per block
    # written, their bytes summing to the totals; a tiny model's blocks fit the first bucket.
    buckets = {(sample.labels["transfer_type"], sample.labels["le"]): sample.value
               for sample in scraped if sample.name == "vllm:kv_offload_size_bucket"}
    assert samples[("vllm:kv_offload_size_count", "DISK_to_GPU")] == counters.kv_offload_loads >= 2
    written = sum(counters.kv_offload_sizes["GPU_to_DISK"].counts)
    assert samples[("vllm:kv_offload_size_count", "GPU_to_DISK")] == written > 0
    for kind in ("DISK_to_GPU", "GPU_to_DISK"):
        assert samples[("vllm:kv_offload_size_sum", kind)] \
            == samples[("vllm:kv_offload_total_bytes_total", kind)]
        assert buckets[(kind, "1e+06")] == buckets[(kind, "+Inf")] \
            == samples[("vllm:kv_offload_size_count", kind)]
        assert len([key for key in buckets if key[0] == kind]) == 11
    assert block_files(tmp_path)  # shutdown saved the pool's blocks


def test_a_prompt_whose_prefix_loads_waits_while_the_next_one_runs(make_engine, run_engine,
                                                                  tmp_path):
    engine = tier_engine(make_engine, tmp_path, max_num_seqs=2)
    run_engine(engine, [PREFIX], GREEDY)
    run_engine(engine, OTHERS, GREEDY)  # the prefix goes to the tier
    loading = engine.add_request(PREFIX, GREEDY)
    other = engine.add_request(random_prompt(3, 12), GREEDY)
    first = engine.step().record
    assert [chunk[0] for chunk in first.chunks] == [other.request_id]
    assert engine.kv_tier.num_loading == 1 and engine.num_waiting == 1
    engine.kv_tier.io.drain()  # the load is read: the next step places it and admits the prompt
    second = engine.step().record
    assert loading.request_id in [chunk[0] for chunk in second.chunks]
    assert loading.num_cached_tokens == (len(PREFIX) - 1) // BLOCK * BLOCK
    engine.close()


def test_warm_restart_finds_the_blocks(make_engine, run_engine, tmp_path):
    engine = tier_engine(make_engine, tmp_path)
    expected = run_engine(engine, [PREFIX], GREEDY).outputs[0]
    engine.close()  # saves what the pool still holds
    assert block_files(tmp_path)
    restarted = tier_engine(make_engine, tmp_path)
    assert restarted.kv_tier.store.num_blocks == len(block_files(tmp_path))
    output = run_engine(restarted, [PREFIX], GREEDY).outputs[0]
    assert output.outputs[0].token_ids == expected.outputs[0].token_ids
    assert output.num_cached_tokens == (len(PREFIX) - 1) // BLOCK * BLOCK
    restarted.close()


def test_corrupt_and_torn_files_are_deleted_and_never_served(make_engine, run_engine, tmp_path):
    engine = tier_engine(make_engine, tmp_path)
    expected = run_engine(engine, [PREFIX], GREEDY).outputs[0]
    engine.close()
    store = DiskStore(tmp_path, block_files(tmp_path)[0].parent.name, 1 << 30)
    keys = [store.key(block_hash[0]) for block_hash in _prefix_hashes()]
    paths = [store.folder / f"{key.hex()}{SUFFIX}" for key in keys]
    assert all(path.is_file() for path in paths)
    flipped = bytearray(paths[1].read_bytes())
    flipped[HEADER.size + 5] ^= 0xFF  # a payload byte: only the checksum can tell
    paths[1].write_bytes(bytes(flipped))
    with open(paths[3], "r+b") as file:  # torn: cut mid-payload
        file.truncate(HEADER.size + 10)

    restarted = tier_engine(make_engine, tmp_path)
    output = run_engine(restarted, [PREFIX], GREEDY).outputs[0]
    assert output.outputs[0].token_ids == expected.outputs[0].token_ids
    assert output.num_cached_tokens == BLOCK  # block 0 only: block 1 is corrupt
    # The load read both files: each failed its checks and was deleted.
    assert not paths[1].exists() and not paths[3].exists()
    assert restarted.kv_tier.store.num_corrupt_deleted == 2
    restarted.close()


def _prefix_hashes():
    manager = KVCacheManager(16, BLOCK)
    return manager.prompt_block_hashes(make_sequence(PREFIX))


def test_another_fingerprint_is_never_read_and_can_be_pruned(make_engine, run_engine, tmp_path,
                                                             caplog):
    engine = tier_engine(make_engine, tmp_path)
    run_engine(engine, [PREFIX], GREEDY)
    engine.close()
    with caplog.at_level(logging.WARNING):
        other = tier_engine(make_engine, tmp_path, kv_cache_dtype="int8")
    assert "another fingerprint" in caplog.text and "kv_offload_dir" in caplog.text
    output = run_engine(other, [PREFIX], GREEDY).outputs[0]
    assert output.num_cached_tokens == 0 and other.kv_tier.stats.hits == 0
    (foreign,) = other.kv_tier.store.foreign_tiers()
    assert foreign.fingerprint == engine.kv_tier.store.fingerprint and foreign.num_files > 0
    assert other.kv_tier.store.prune_foreign() > 0
    assert not (tmp_path / foreign.fingerprint).exists()
    other.close()


@pytest.mark.parametrize("knobs, message", [
    ({"kv_offload_dir": "/tmp/t", "kv_offload_gb": 0}, "kv_offload_gb=0 must be > 0"),
    ({"kv_offload_dir": "", "kv_offload_gb": 1}, "kv_offload_dir='' must be a directory"),
    ({"kv_offload_dir": "/tmp/t", "enable_prefix_caching": False}, "enable_prefix_caching"),
])
def test_bad_knobs_are_refused_by_name(knobs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**knobs)


def test_unusable_directory_or_size_warns_and_the_engine_runs(make_engine, run_engine, tmp_path,
                                                             caplog):
    a_file = tmp_path / "file"
    a_file.write_text("")
    with caplog.at_level(logging.WARNING):
        engine = make_engine("llama", **POOL, kv_offload_dir=str(a_file / "tier"))
    assert engine.kv_tier is None and "kv_offload_dir=" in caplog.text
    assert run_engine(engine, [PREFIX], GREEDY).outputs[0].finished
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        huge = make_engine("llama", **POOL, kv_offload_dir=str(tmp_path / "t"),
                           kv_offload_gb=1e9)
    assert "kv_offload_gb=1e+09 is larger than the free disk" in caplog.text
    assert huge.kv_tier.store.capacity_bytes < 1e9 * (1 << 30)
    huge.close()


def test_lru_eviction_keeps_the_tier_within_its_size(tmp_path):
    store = DiskStore(tmp_path, "ab" * 16, 3 * (HEADER.size + 100))
    for index in range(3):
        assert store.put(bytes([index]) * 16, bytes(100))
    assert store.get(bytes([0]) * 16) is not None  # 0 is now the most recently used
    assert store.put(bytes([3]) * 16, bytes(100))
    assert bytes([1]) * 16 not in store and bytes([0]) * 16 in store
    assert store.num_blocks == 3 and store.num_bytes <= store.capacity_bytes
    assert len(list(store.folder.glob(f"*{SUFFIX}"))) == 3


def test_writers_killed_mid_write_leave_nothing_corrupt():
    """Two writers sharing a directory, SIGKILLed mid-write, then a restart, twice
    (bench/kv_tier_crash.py does it 20 times): the index is rebuilt from whole files, the
    dead writers' temporary files are gone, every block served is exactly what was
    written."""
    bench = Path(__file__).resolve().parents[1] / "bench" / "kv_tier_crash.py"
    result = subprocess.run([sys.executable, str(bench), "--kills", "2"], capture_output=True,
                            text=True, timeout=300, check=True)
    report = json.loads(result.stdout)
    assert report["blocks_served_over_restarts"] > 0 and report["wrong_blocks_served"] == 0
    assert report["tmp_files_after_restarts"] == 0 and report["index_rebuilt_every_time"]


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 1 MiB filesystem (tmpfs), where the machine lets this user mount one."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_a_full_disk_stops_the_writes_and_reads_go_on(tiny_disk, caplog):
    store = DiskStore(tiny_disk, "ef" * 16, 1 << 30)  # larger than the disk
    with caplog.at_level(logging.WARNING):
        written = [key for key in (index.to_bytes(16, "little") for index in range(40))
                   if store.put(key, bytes(100_000))]
    assert 3 < len(written) < 40 and store.full_disk is not None
    assert "the disk is full" in caplog.text
    assert not list(store.folder.glob("*.tmp"))  # the failed write left nothing behind
    assert all(bytes(store.get(key)) == bytes(100_000) for key in written)
    assert not store.put((99).to_bytes(16, "little"), bytes(10))  # stopped, even if it fits


def test_transfer_sizes_fall_in_vllms_buckets_bounds_inclusive():
    sizes = TransferSizes()
    for size in (0, 1_000_000, 1_000_001, 250_000_000):
        sizes.observe(size)
    buckets = dict(sizes.cumulative())
    assert (buckets[1e6], buckets[5e6], buckets[200e6], buckets[math.inf]) == (2, 3, 3, 4)
    assert len(buckets) == len(SIZE_BUCKETS) + 1
    earlier = sizes.copy()
    sizes.observe(10)
    assert (sizes - earlier).counts[0] == 1 and (sizes - earlier).num_bytes == 10
    assert (earlier + earlier).num_bytes == 2 * earlier.num_bytes
    assert sum([earlier, sizes]).counts == (earlier + sizes).counts  # replicas sum from 0


def test_each_steps_tier_counts_round_trip_the_session_log_its_exports_and_the_sessions_tab(
        make_engine, run_engine, tmp_path):
    engine = tier_engine(make_engine, tmp_path / "tier")
    records = run_engine(engine, [PREFIX], GREEDY).records
    records += run_engine(engine, OTHERS, GREEDY).records
    engine.kv_tier.io.drain()  # the evicted prefix is on disk before it is asked for
    records += run_engine(engine, [PREFIX], GREEDY).records
    stats = engine.kv_tier.stats
    steps = [dict(zip(TIER_STEP_FIELDS, record.kv_tier, strict=True)) for record in records]
    assert len(steps) == len(records)  # every step of an engine with a tier counts it
    # The steps' counts are the tier's own, step by step, without loss or double counting.
    for field, total in (("blocks_loaded", stats.blocks_loaded), ("loads", stats.loads),
                         ("bytes_loaded", stats.bytes_loaded), ("hit_tokens", stats.hits),
                         ("query_tokens", stats.queries), ("blocks_stored", stats.blocks_stored)):
        assert sum(step[field] for step in steps) == total, field
    assert stats.hits > 0 and stats.blocks_stored > 0
    assert steps[-1]["blocks_held"] == engine.kv_tier.store.num_blocks > 0
    engine.close()

    log = SessionLog(tmp_path / "log.db")
    session_id = log.start_session(engine.config.to_dict(), model="tiny")
    for record in records:
        log.record_step(record)
    log.close()
    database = open_database(tmp_path / "log.db")
    stored = load_session(database, session_id)
    assert stored.steps == records
    (path,) = [export_session(database, session_id, "json", tmp_path)]
    exported = json.loads(path.read_text())["steps"]
    assert [row["tier_hit_tokens"] for row in exported] == [s["hit_tokens"] for s in steps]
    line = session_tier_markdown(stored.steps)
    hits = f"{stats.hits}/{stats.queries} tokens"
    assert hits in line and f"{stats.loads} loads" in line
    assert session_tier_markdown([dataclasses.replace(r, kv_tier=()) for r in records]) == ""
