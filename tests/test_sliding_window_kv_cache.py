"""The KV manager with sliding windows: a sliding group's blocks that leave the window are
freed while the sequence runs (a full group beside it keeps all), a decoding sequence holds
at most ceil(W / block_size) + 1 blocks per sliding group, and the freed blocks stay in the
prefix cache; the memory plan counts sequences by that bound, group by group."""

import pytest
from conftest import TINY_WINDOW, make_sequence
from test_block_pool import admit, check_pool_invariants, check_windows_held, visible_positions

from kvscope.engine.core.kv_cache_manager import RELEASED, KVCacheManager
from kvscope.engine.core.kv_groups import KVCacheGroup, kv_cache_groups
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.memory import plan_blocks


def check_released_exactly_before_the_window(manager: KVCacheManager, seq) -> None:
    """As a step computes the token at position p: a sliding group's entry is RELEASED just
    where no key the token sees, (p - W, p], lies in that block; a full group's never."""
    size = manager.block_size
    for group, window in enumerate(manager.group_windows):
        first_seen = visible_positions(seq.num_computed_tokens, window).start
        table = manager.group_table(seq, group)
        expected = [window is not None and (block + 1) * size <= first_seen
                    for block in range(len(table))]
        assert [entry == RELEASED for entry in table] == expected, (
            f"group {group} (window {window}) at position {seq.num_computed_tokens}: "
            f"table {table}")


def decode(manager: KVCacheManager, seq, count: int) -> list[int]:
    """Append `count` tokens one step at a time, checking as each step's token is computed
    that its group tables hold exactly the blocks its window sees; the blocks held after
    each step."""
    held = []
    for token in range(count):
        seq.token_ids.append(token % 7)
        assert manager.allocate_slots(seq, 1) is not None
        check_released_exactly_before_the_window(manager, seq)
        seq.num_computed_tokens += 1
        check_windows_held(manager, [seq])
        manager.cache_full_blocks(seq)
        held.append(len(manager.held_blocks(seq.block_table)))
    return held


@pytest.mark.parametrize("layout", ["sliding", "hybrid"])
@pytest.mark.parametrize(("window", "block_size"), [(8, 2), (8, 4), (6, 4), (5, 1), (16, 16)])
def test_a_decoding_sequence_holds_its_window_not_its_length(window, block_size, layout):
    """Alone, or beside a full group (which keeps a block per position), a sliding group's
    table holds at most ceil(W / block_size) + 1 blocks at every decode step."""
    groups = (window,) if layout == "sliding" else (window, None, window)
    manager = KVCacheManager(num_blocks=256, block_size=block_size, group_windows=groups)
    seq = make_sequence(list(range(3 * window)))
    assert admit(manager, seq)
    bound = -(-window // block_size) + 1
    held = []
    for _ in range(10 * window):
        decode(manager, seq, 1)
        held.append([len(manager.held_blocks(manager.group_table(seq, group)))
                     for group in range(len(groups))])

    positions = -(-seq.num_tokens // block_size)
    assert len(seq.block_table) == positions * len(groups)  # positions keep indexes
    released = seq.num_released_blocks
    for group, window_of_group in enumerate(groups):
        table = manager.group_table(seq, group)
        if window_of_group is None:
            assert held[-1][group] == positions and RELEASED not in table
        else:
            assert max(step[group] for step in held) <= bound
            assert released > 0 and table[:released] == [RELEASED] * released
    assert manager.pool.num_used_blocks == sum(held[-1])
    check_pool_invariants(manager.pool, [seq])
    manager.free(seq)
    assert manager.pool.num_used_blocks == 0


def test_without_a_window_every_block_stays():
    manager = KVCacheManager(num_blocks=64, block_size=4)
    seq = make_sequence(list(range(20)))
    assert admit(manager, seq)
    assert decode(manager, seq, 20)[-1] == 10


def test_released_blocks_stay_cached_and_a_later_prompt_takes_only_its_window():
    manager = KVCacheManager(num_blocks=32, block_size=4, group_windows=(6,))
    first = make_sequence(list(range(30)))
    assert admit(manager, first)
    decode(manager, first, 4)  # the first blocks leave the window (and the pool's use)
    assert first.num_released_blocks > 0
    free_before = manager.pool.num_free_blocks

    again = make_sequence(list(range(30)))
    prefix = manager.find_cached_prefix(again)
    assert len(prefix) == 29 // 4  # the whole prefix is still cached, released blocks too
    assert admit(manager, again)
    # Only the blocks the window of the first token past the prefix sees were taken; the
    # rest are RELEASED: the token at position 28 sees keys 23..28, so blocks 0..4 (keys
    # 0..19) were not.
    assert again.block_table[:5] == [RELEASED] * 5 and RELEASED not in again.block_table[5:]
    check_windows_held(manager, [first, again])
    assert manager.pool.num_free_blocks >= free_before - 3
    check_pool_invariants(manager.pool, [first, again])


def test_swap_out_and_in_keeps_the_released_positions():
    manager = KVCacheManager(num_blocks=64, block_size=4, num_swap_blocks=24,
                             group_windows=(8, None))
    seq = make_sequence(list(range(30)))
    assert admit(manager, seq)
    decode(manager, seq, 2)
    table, released = list(seq.block_table), seq.num_released_blocks
    copies = manager.swap_out(seq)
    assert [device for device, _ in copies] == [b for b in table if b != RELEASED]
    back = manager.swap_in(seq, 1)
    assert len(back) == len(copies)
    check_windows_held(manager, [seq])
    # The same entries are released (the sliding group's first ones), the full group's none.
    assert [b == RELEASED for b in seq.block_table[:len(table)]] == [b == RELEASED for b in table]
    assert seq.num_released_blocks == released == manager.group_table(seq, 0).count(RELEASED)
    assert RELEASED not in manager.group_table(seq, 1)
    check_pool_invariants(manager.pool, [seq])


def test_a_full_group_beside_sliding_ones_must_hit_its_whole_prefix():
    """With a full group, a prefix hit needs every one of its blocks; the sliding groups
    only the window's, and a prefix hit adopts no sliding block before the window."""
    manager = KVCacheManager(num_blocks=64, block_size=4, group_windows=(6, None))
    first = make_sequence(list(range(30)))
    assert admit(manager, first)
    decode(manager, first, 2)  # 32 tokens: 8 positions, the sliding group freed 6
    again = make_sequence(list(range(30)))
    prefix = manager.find_cached_prefix(again)
    assert len(prefix) == 7
    skipped = 5  # position 28 sees keys 23..28: blocks 5 and 6 of the prefix, not 0..4
    assert all(sliding is None and full is not None for sliding, full in prefix[:skipped])
    assert all(None not in blocks for blocks in prefix[skipped:])
    assert admit(manager, again)
    assert manager.group_table(again, 0)[:skipped] == [RELEASED] * skipped
    assert RELEASED not in manager.group_table(again, 1)
    check_pool_invariants(manager.pool, [first, again])
    check_windows_held(manager, [first, again])


def test_layers_group_by_attention_type_in_equal_sizes():
    """vLLM's grouping: each type's layers cut into groups of the smallest type's count,
    ordered by their first layer (Gemma 3 1B: every sixth layer global)."""
    windows = [None if layer % 6 == 5 else 512 for layer in range(26)]
    groups = kv_cache_groups(windows)
    assert [group.window for group in groups] == [512, 512, None, 512, 512, 512, 512]
    assert groups[2] == KVCacheGroup(None, (5, 11, 17, 23))
    assert sorted(layer for group in groups for layer in group.layers) == list(range(26))
    assert {len(group.layers) for group in groups} == {4, 2}
    assert kv_cache_groups([None] * 3) == [KVCacheGroup(None, (0, 1, 2))]
    with pytest.raises(ValueError, match="one window"):
        kv_cache_groups([4, 8, None])


def test_the_memory_plan_counts_max_length_sequences_by_the_window():
    args = dict(device_memory_bytes=1 << 30, gpu_memory_utilization=1.0, weight_bytes=0,
                peak_activation_bytes=0, bytes_per_block=1 << 20, block_size=16,
                max_model_len=8192)
    full = plan_blocks(**args)
    windowed = plan_blocks(**args, groups=(KVCacheGroup(512, (0, 1)),))
    assert full.max_concurrency == 1024 / 512
    assert windowed.max_concurrency == 1024 / 33
    assert windowed.full_attention_concurrency == full.max_concurrency
    assert "window 512 (2 layers) 33.0 MiB" in windowed.describe()


def test_the_memory_plan_counts_each_groups_blocks():
    """Gemma 3 1B's layout at 8k context: blocks of 4 layers; a sequence holds 512 blocks in
    the full group and 33 in each of six sliding ones, against 26 layers x 512 blocks
    under full attention: 13312 / (4 x 710) = 4.69x as many sequences."""
    groups = tuple(kv_cache_groups([None if layer % 6 == 5 else 512 for layer in range(26)]))
    plan = plan_blocks(1 << 30, 1.0, 0, 0, 1 << 18, 16, 8192, groups=groups)
    assert plan.group_blocks_per_max_len_seq() == [33, 33, 512, 33, 33, 33, 33]
    assert plan.max_concurrency == 4096 / 710
    assert plan.full_attention_concurrency == 4096 * 4 / (26 * 512)
    assert plan.max_concurrency / plan.full_attention_concurrency == pytest.approx(4.69, abs=0.01)
    assert "full (4 layers) 128.0 MiB" in plan.describe()
    # The pool must hold one max_model_len prompt in all seven groups before any window frees.
    with pytest.raises(ValueError, match="in 7 KV cache groups"):
        plan_blocks(1 << 30, 1.0, 0, 0, 1 << 20, 16, 8192, groups=groups)


def test_an_engine_frees_out_of_window_blocks_as_it_decodes(make_engine):
    engine = make_engine("mistral-window", block_size=2)
    assert engine.kv_cache.group_windows == (TINY_WINDOW,)
    engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=20, ignore_eos=True))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        held += [len(engine.kv_cache.held_blocks(seq.block_table))
                 for seq in engine.scheduler.running]
        check_windows_held(engine.kv_cache, engine.scheduler.running)
    assert max(held[1:]) <= -(-TINY_WINDOW // 2) + 1  # after the prompt's own step
    assert engine.kv_cache.pool.num_used_blocks == 0


@pytest.mark.parametrize("arch", ["qwen2-window", "gemma3", "gemma2"])
def test_an_engine_with_a_full_attention_layer_frees_only_the_sliding_groups(arch, make_engine):
    """Qwen2's first layer, Gemma's global layers: their group keeps every block while the
    sliding groups hold their window."""
    engine = make_engine(arch, block_size=2)
    kv = engine.kv_cache
    assert None in kv.group_windows and TINY_WINDOW in kv.group_windows
    engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=20, ignore_eos=True))
    bound, seen = -(-TINY_WINDOW // 2) + 1, 0
    while engine.has_unfinished_requests():
        engine.step()
        check_windows_held(kv, engine.scheduler.running)
        for seq in engine.scheduler.running:
            for group, window in enumerate(kv.group_windows):
                held = len(kv.held_blocks(kv.group_table(seq, group)))
                if window is None:
                    assert held == -(-seq.num_computed_tokens // 2)
                elif seq.num_output_tokens > 1:
                    assert held <= bound
                    seen += 1
    assert seen > 0 and kv.pool.num_used_blocks == 0


def _decoding(engine, steps: int):
    """The engine a few steps into one 29-token prompt: (engine, its sequence, a mirror)."""
    from kvscope.engine.telemetry.pool_recorder import mirror_of

    engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(steps):
        engine.step()
    (seq,) = engine.scheduler.running
    return engine, seq, mirror_of(engine)


def test_the_dashboard_draws_what_full_attention_would_hold(make_engine):
    from kvscope.ui.figures import (
        _shown_columns,
        block_table_map,
        compare_memory,
        paged_vs_contiguous,
        table_columns,
    )

    engine, seq, mirror = _decoding(make_engine("mistral-window", block_size=2), steps=6)
    assert mirror.blocks_released_by_window == seq.num_released_blocks > 0
    comparison = compare_memory(mirror)
    assert comparison.full_attention_reserved_tokens == (
        comparison.paged_reserved_tokens + 2 * seq.num_released_blocks)
    figure = paged_vs_contiguous(mirror)
    line = figure["layout"]["shapes"][-1]
    assert line["x0"] == comparison.full_attention_reserved_tokens
    assert "full attention would hold" in figure["layout"]["annotations"][-1]["text"]
    # the block table draws the released entries blank, labelled "freed" (of the columns
    # a long table shows: its first and last ones)
    row = block_table_map(mirror)["data"][0]["text"][0]
    shown = _shown_columns(len(seq.block_table), table_columns(mirror.num_blocks))
    assert [text == "freed" for text in row[:len(shown)]] == (
        [index < seq.num_released_blocks for index in shown])
    while engine.has_unfinished_requests():
        engine.step()


def test_a_prefix_whose_oldest_blocks_were_evicted_still_hits_within_the_window():
    manager = KVCacheManager(num_blocks=12, block_size=4, group_windows=(6,))
    first = make_sequence(list(range(30)))
    assert admit(manager, first)
    decode(manager, first, 2)  # 32 tokens: 8 full blocks, all hashed; the first 6 released
    manager.free(first)
    # 4 plain free blocks, then the least recently freed cached ones: the first two released
    filler = make_sequence(list(range(100, 124)))
    assert admit(manager, filler)
    again = make_sequence(list(range(30)))
    prefix = manager.find_cached_prefix(again)

    assert len(prefix) == 7  # 28 of 30 tokens, though blocks 0 and 1 are gone
    assert prefix[:2] == [(None,), (None,)] and all(block is not None for (block,) in prefix[5:])
    assert admit(manager, again)
    assert again.block_table[:5] == [RELEASED] * 5
    check_pool_invariants(manager.pool, [filler, again])
    check_windows_held(manager, [filler, again])


def test_the_dashboard_draws_each_groups_table_and_tells_the_groups_apart(make_engine):
    """Gemma 3 (two sliding groups, one full): a block-table row per group, the sliding
    rows' old entries freed, the full row's kept; the heatmap marks each kind of group on
    the blocks it holds; the full-attention line counts the freed entries."""
    from kvscope.ui.figures import block_table_map, compare_memory, pool_heatmap

    engine, seq, mirror = _decoding(make_engine("gemma3", block_size=2), steps=4)
    assert mirror.group_windows == [TINY_WINDOW, TINY_WINDOW, None]
    groups = mirror.block_groups()
    for group in range(3):
        held = [b for b in engine.kv_cache.group_table(seq, group) if b != RELEASED]
        assert set(groups[held].tolist()) == {group}

    table = block_table_map(mirror)["data"][0]
    labels = table["y"]
    assert [label.split("· ")[-1] for label in labels] == [
        f"group 0: window {TINY_WINDOW}", f"group 1: window {TINY_WINDOW}", "group 2: full"]
    first_cells = [row[0] for row in table["text"]]
    assert first_cells[:2] == ["freed", "freed"] and first_cells[2] != "freed"

    # One cell per block (the first 256, where the pool handed out these blocks).
    assert max(seq.block_table) < 256
    markers = {trace["name"]: trace for trace in pool_heatmap(
        mirror, view="block range", start=0, stop=256)["data"]
               if trace.get("name", "").endswith(("groups", f"(W={TINY_WINDOW})"))}
    full, sliding = (markers["full-attention groups"],
                     markers[f"sliding-window groups (W={TINY_WINDOW})"])
    assert len(full["x"]) == len(engine.kv_cache.held_blocks(engine.kv_cache.group_table(seq, 2)))
    assert len(sliding["x"]) == sum(len(engine.kv_cache.held_blocks(
        engine.kv_cache.group_table(seq, group))) for group in (0, 1))
    comparison = compare_memory(mirror)
    assert comparison.full_attention_reserved_tokens == (
        comparison.paged_reserved_tokens + 2 * 2 * seq.num_released_blocks)
    while engine.has_unfinished_requests():
        engine.step()
