"""The KV manager with a sliding window: blocks that leave the window are freed while the
sequence runs, a decoding sequence holds at most ceil(W / block_size) + 1 blocks, and the
freed blocks stay in the prefix cache; the memory plan counts sequences by that bound."""

import pytest
from conftest import TINY_WINDOW, make_sequence
from test_block_pool import admit, check_pool_invariants

from kvscope.engine.core.kv_cache_manager import RELEASED, KVCacheManager
from kvscope.engine.sample.sampling_params import SamplingParams
from kvscope.engine.worker.memory import plan_blocks


def decode(manager: KVCacheManager, seq, count: int) -> list[int]:
    """Append `count` tokens one step at a time; the blocks held after each step."""
    held = []
    for token in range(count):
        seq.token_ids.append(token % 7)
        assert manager.allocate_slots(seq, 1) is not None
        seq.num_computed_tokens += 1
        manager.cache_full_blocks(seq)
        held.append(len(manager.held_blocks(seq.block_table)))
    return held


@pytest.mark.parametrize(("window", "block_size"), [(8, 2), (8, 4), (6, 4), (5, 1), (16, 16)])
def test_a_decoding_sequence_holds_its_window_not_its_length(window, block_size):
    manager = KVCacheManager(num_blocks=64, block_size=block_size, sliding_window=window)
    seq = make_sequence(list(range(3 * window)))
    assert admit(manager, seq)
    held = decode(manager, seq, 10 * window)

    bound = -(-window // block_size) + 1
    assert max(held) <= bound
    assert len(seq.block_table) == -(-seq.num_tokens // block_size)  # positions keep indexes
    released = seq.num_released_blocks
    assert released > 0 and seq.block_table[:released] == [RELEASED] * released
    assert manager.pool.num_used_blocks == held[-1]
    check_pool_invariants(manager.pool, [seq])
    manager.free(seq)
    assert manager.pool.num_used_blocks == 0


def test_without_a_window_every_block_stays():
    manager = KVCacheManager(num_blocks=64, block_size=4)
    seq = make_sequence(list(range(20)))
    assert admit(manager, seq)
    assert decode(manager, seq, 20)[-1] == 10


def test_released_blocks_stay_cached_and_a_later_prompt_takes_only_its_window():
    manager = KVCacheManager(num_blocks=32, block_size=4, sliding_window=6)
    first = make_sequence(list(range(30)))
    assert admit(manager, first)
    decode(manager, first, 4)  # the first blocks leave the window (and the pool's use)
    assert first.num_released_blocks > 0
    free_before = manager.pool.num_free_blocks

    again = make_sequence(list(range(30)))
    prefix = manager.find_cached_prefix(again)
    assert len(prefix) == 29 // 4  # the whole prefix is still cached, released blocks too
    assert admit(manager, again)
    # Only the blocks the next token's window sees were taken; the rest are RELEASED.
    skipped = manager.first_kept_block(len(prefix) * 4)
    assert again.block_table[:skipped] == [RELEASED] * skipped
    assert manager.pool.num_free_blocks >= free_before - 3
    check_pool_invariants(manager.pool, [first, again])


def test_swap_out_and_in_keeps_the_released_positions():
    manager = KVCacheManager(num_blocks=32, block_size=4, num_swap_blocks=8, sliding_window=8)
    seq = make_sequence(list(range(30)))
    assert admit(manager, seq)
    decode(manager, seq, 2)
    table = list(seq.block_table)
    copies = manager.swap_out(seq)
    assert [device for device, _ in copies] == [b for b in table if b != RELEASED]
    back = manager.swap_in(seq, 1)
    assert len(back) == len(copies)
    assert seq.block_table[:seq.num_released_blocks] == table[:seq.num_released_blocks]
    assert seq.num_released_blocks == table.count(RELEASED)
    check_pool_invariants(manager.pool, [seq])


def test_the_memory_plan_counts_max_length_sequences_by_the_window():
    args = dict(device_memory_bytes=1 << 30, gpu_memory_utilization=1.0, weight_bytes=0,
                peak_activation_bytes=0, bytes_per_block=1 << 20, block_size=16,
                max_model_len=8192)
    full = plan_blocks(**args)
    windowed = plan_blocks(**args, sliding_window=512)
    assert full.max_concurrency == 1024 / 512
    assert windowed.max_concurrency == 1024 / 33
    assert windowed.full_attention_concurrency == full.max_concurrency
    assert "sliding window 512" in windowed.describe()


def test_an_engine_frees_out_of_window_blocks_as_it_decodes(make_engine):
    engine = make_engine("mistral-window", block_size=2)
    assert engine.kv_cache.sliding_window == TINY_WINDOW
    engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=20, ignore_eos=True))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        held += [len(engine.kv_cache.held_blocks(seq.block_table))
                 for seq in engine.scheduler.running]
    assert max(held[1:]) <= -(-TINY_WINDOW // 2) + 1  # after the prompt's own step
    assert engine.kv_cache.pool.num_used_blocks == 0


def test_an_engine_with_a_full_attention_layer_keeps_every_block(make_engine):
    assert make_engine("qwen2-window", block_size=2).kv_cache.sliding_window is None


def test_the_dashboard_draws_what_full_attention_would_hold(make_engine):
    from kvscope.engine.telemetry.pool_recorder import mirror_of
    from kvscope.ui.figures import (
        _shown_columns,
        block_table_map,
        compare_memory,
        paged_vs_contiguous,
        table_columns,
    )

    engine = make_engine("mistral-window", block_size=2)
    engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(6):
        engine.step()
    (seq,) = engine.scheduler.running
    mirror = mirror_of(engine)
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
    manager = KVCacheManager(num_blocks=12, block_size=4, sliding_window=6)
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
    assert prefix[:2] == [None, None] and all(block is not None for block in prefix[5:])
    assert admit(manager, again)
    assert again.block_table[:5] == [RELEASED] * 5
    check_pool_invariants(manager.pool, [filler, again])
