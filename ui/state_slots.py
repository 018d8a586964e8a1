"""The state slots panel (a model with recurrent layers): which running sequence holds each
slot, which slots keep prefix snapshots, and what a slot costs against a block.

The slot table is read live from the engine (EngineView.state_slot_table), not from the
pool records: the saved sessions' schema stays as it was, so a recorded frame has no
slot table to show."""

from kvscope.engine.core.state_slots import SlotTable
from kvscope.engine.worker.memory import MemoryPlan

HASH_CHARS = 12  # of a snapshot's block hash: enough to tell the prefix tree's nodes apart


def state_slots_markdown(table: SlotTable | None, plan: MemoryPlan) -> str:
    """The panel's text; table None: a recorded frame, whose slots were not kept."""
    costs = (f"**{plan.bytes_per_state_slot} bytes per slot** against "
             f"{plan.bytes_per_block} bytes per block: a slot is "
             f"{plan.bytes_per_state_slot / plan.bytes_per_block:.2f} blocks' bytes, one "
             f"per running sequence whatever its length")
    if table is None:
        return (f"**State slots:** {plan.num_state_slots} · {costs}\n\n*A recorded frame "
                "keeps no slot table (it is read live from the engine): press Live to see "
                "it.*")
    lines = [f"**State slots:** {table.num_slots} · {len(table.held)} held by running "
             f"sequences · {len(table.snapshots)} keeping prefix snapshots · "
             f"{table.num_free} free · {costs}", "", "| slot | holds |", "|---|---|"]
    rows = [(slot, f"request {request_id}, sequence {seq_id}")
            for slot, request_id, seq_id in table.held]
    rows += [(slot, f"snapshot: the state after block {block_hash[:HASH_CHARS]}… (marked "
                    "'state' in the prefix tree)") for slot, block_hash in table.snapshots]
    lines += [f"| {slot} | {holds} |" for slot, holds in sorted(rows)]
    if not rows:
        lines.append("| - | every slot is free |")
    return "\n".join(lines)
