"""A prompt being prefilled reads as running to every reader of the pool feed (dashboard,
/metrics): the served engine publishes the pool once the scheduler has admitted it and
given it the chunk's blocks, before the (possibly seconds-long) step computes."""

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.async_engine import AsyncEngine
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.records import PoolDelta, SequenceChange

BLOCK_SIZE = 4
BUDGET = 32


def test_a_prefilling_prompt_is_published_running_with_its_blocks_chunk_by_chunk(
        tiny_chat_model_path) -> None:
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_chat_model_path), dtype="float32", device="cpu", block_size=BLOCK_SIZE,
        num_gpu_blocks_override=128, max_model_len=256, max_num_batched_tokens=BUDGET,
        enable_chunked_prefill=True)).start()
    try:
        feed = engine.subscribe_pool()
        prompt = [3 + i % 90 for i in range(4 * BUDGET)]  # four chunks of the budget
        list(engine.submit(prompt, SamplingParams(max_tokens=2, ignore_eos=True)))
        engine.snapshot()  # answered after the last step's records are published
        changes = [SequenceChange._make(row) for record in feed.drain()
                   if isinstance(record, PoolDelta) for row in record.sequences]
    finally:
        engine.shutdown()
    prefilling = {(change.num_computed_tokens, change.table_from + len(change.table_tail))
                  for change in changes if change.status == "running"
                  and change.num_computed_tokens < len(prompt)}
    # Published before each chunk computes: running, holding the blocks of the chunk it is
    # computing (the state after a step alone never shows a chunk's blocks uncomputed).
    per_chunk = BUDGET // BLOCK_SIZE
    assert {(chunk * BUDGET, (chunk + 1) * per_chunk) for chunk in range(4)} <= prefilling
