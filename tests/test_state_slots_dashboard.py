"""The dashboard on a model with recurrent layers (tiny LFM2): the Live tab's state slots
panel names the sequence holding each slot and the prefix snapshots kept, the prefix tree
marks the blocks with a snapshot, and the memory panel sets the plan against a
full-attention model of the same size."""

import json
import re

import pytest
from conftest import wait_until

from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.sampling_params import SamplingParams
from kvscope.ui import knobs, panels
from kvscope.ui.live import LiveFeeds

PROMPT = list(range(3, 40))  # 37 tokens: nine full blocks of 4, snapshots every 2 blocks


@pytest.fixture(scope="module")
def engine(make_engine):
    engine = AsyncEngine(make_engine("lfm2", block_size=4, max_model_len=256, max_num_seqs=4,
                                     max_num_batched_tokens=8, enable_prefix_caching=True,
                                     state_snapshot_every_n_blocks=2)).start()
    yield engine
    engine.shutdown()


def rendered(renderer: panels.PanelRenderer, name: str):
    *values, _ = renderer.refresh(None)
    return values[panels.PANELS.index(name)]


def test_the_state_slots_panel_names_each_slots_holder(engine):
    renderer = panels.PanelRenderer(LiveFeeds(engine))
    plan = engine.memory_plan
    stream = engine.submit(PROMPT, SamplingParams(temperature=0, max_tokens=200,
                                                  ignore_eos=True))
    held = re.compile(r"<td>\d+</td>\s*<td>request (\S+), sequence \S+</td>")
    wait_until(lambda: held.search(rendered(renderer, "state_slots")), timeout=30,
               what="the running request in the slot table")
    text = rendered(renderer, "state_slots")
    assert held.search(text).group(1) == stream.request_id
    assert f"{plan.bytes_per_state_slot} bytes per slot" in text
    assert f"{plan.bytes_per_block} bytes per block" in text
    assert f"<strong>State slots:</strong> {plan.num_state_slots} " in text
    list(stream)


def test_snapshots_show_in_the_slot_table_and_the_prefix_tree(engine):
    renderer = panels.PanelRenderer(LiveFeeds(engine))
    list(engine.submit(PROMPT, SamplingParams(temperature=0, max_tokens=2)))
    engine.snapshot()  # the engine thread has published the finished request's delta
    table = engine.state_slot_table()
    assert table.snapshots and not table.held
    text = rendered(renderer, "state_slots")
    for slot, block_hash in table.snapshots:
        assert f"<td>{slot}</td>\n<td>snapshot: the state after block {block_hash[:12]}" in text
    icicle = json.loads(rendered(renderer, "prefix_tree").plot)["data"][0]
    marked = [node for node, label in zip(icicle["ids"], icicle["labels"], strict=True)
              if label.endswith("state")]
    assert sorted(marked) == sorted(block_hash for _, block_hash in table.snapshots)


def test_the_memory_panel_compares_a_full_attention_model_of_the_same_size(engine):
    plan = engine.memory_plan
    attention_layers = sum(len(group.layers) for group in plan.groups)
    assert 0 < attention_layers < attention_layers + plan.num_state_layers
    text = knobs.pool_markdown(plan, engine.config)
    per_layer = plan.bytes_per_block // attention_layers
    full_block = per_layer * (attention_layers + plan.num_state_layers)
    full = plan.num_state_slots * -(-plan.max_model_len // plan.block_size) * full_block
    here = plan.num_state_slots * (plan.blocks_per_max_len_seq * plan.bytes_per_block
                                   + plan.bytes_per_state_slot)
    assert (f"**State slots:** {plan.num_state_slots} x {plan.bytes_per_state_slot} bytes"
            in text)
    assert (f"with every layer full attention ({full_block} bytes/block) they would need "
            f"{full / 2**20:.1f} MiB ({full / here:.2f}x)") in text
