"""The memory budget: (device memory x utilization - weights - activations) // bytes per block."""

import json

import pytest
import torch
from conftest import TINY_MAX_POSITIONS

from kvscope.engine.config import EngineConfig
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.memory import GiB, PoolTooSmall, measure_peak_bytes, plan_blocks
from kvscope.engine.worker.model_runner import ModelRunner
from kvscope.engine.worker.profile_cache import profile_key

MiB = 1 << 20


def test_num_blocks_is_the_budget_divided_by_the_block_size_in_bytes():
    plan = plan_blocks(device_memory_bytes=4 * GiB, gpu_memory_utilization=0.5,
                       weight_bytes=512 * MiB, peak_activation_bytes=256 * MiB,
                       bytes_per_block=1 * MiB, block_size=16, max_model_len=1024)
    assert plan.num_blocks == 2048 - 512 - 256
    assert plan.num_tokens == 1280 * 16
    assert plan.kv_cache_bytes == 1280 * MiB
    assert plan.max_concurrency == pytest.approx(1280 / 64)


def test_a_partial_block_does_not_count():
    plan = plan_blocks(device_memory_bytes=1000, gpu_memory_utilization=0.9, weight_bytes=100,
                       peak_activation_bytes=50, bytes_per_block=100, block_size=2,
                       max_model_len=8)
    assert plan.num_blocks == (900 - 100 - 50) // 100 == 7


def test_override_replaces_the_computed_number():
    plan = plan_blocks(4 * GiB, 0.9, 0, 0, MiB, 16, 1024, num_blocks_override=100)
    assert plan.num_blocks == 100


def test_describe_states_blocks_tokens_bytes_and_concurrency():
    text = plan_blocks(4 * GiB, 0.5, 512 * MiB, 256 * MiB, MiB, 16, 1024).describe()
    assert "1280 blocks x 16 tokens = 20480 tokens" in text
    assert "weights 512.0 MiB" in text
    assert "1.250 GiB" in text
    assert "max_model_len=1024: 20.00x" in text


def test_describe_states_the_weight_bytes_per_type_largest_first():
    by_type = {"float32": 2 * MiB, "Q4_K": 300 * MiB, "Q6_K": 210 * MiB}
    plan = plan_blocks(4 * GiB, 0.5, 512 * MiB, 256 * MiB, MiB, 16, 1024,
                       weight_bytes_by_type=by_type)
    assert "weights 512.0 MiB (Q4_K 300.0, Q6_K 210.0, float32 2.0 MiB);" in plan.describe()


def test_too_little_memory_says_how_many_tokens_fit_and_which_knobs_to_turn():
    with pytest.raises(ValueError) as error:
        # 1 GiB x 0.5 - 256 MiB weights - 192 MiB activations = 64 blocks of 16 = 1024 tokens.
        plan_blocks(GiB, 0.5, 256 * MiB, 192 * MiB, MiB, 16, max_model_len=4096)
    message = str(error.value)
    assert "holds 1024 tokens" in message
    assert "max_model_len=4096" in message
    for knob in ("gpu_memory_utilization", "device_memory_gb", "max_num_batched_tokens"):
        assert knob in message


def test_weights_larger_than_the_budget_leave_zero_blocks_and_fail():
    with pytest.raises(ValueError, match="holds 0 tokens"):
        plan_blocks(GiB, 0.1, GiB, 0, MiB, 16, max_model_len=16)


def test_an_override_too_small_for_one_sequence_fails_naming_the_override():
    """Not the memory knobs (`kvscope replay` with a small override advised raising
    gpu_memory_utilization, which plays no part in an overridden pool)."""
    with pytest.raises(PoolTooSmall, match=r"num_gpu_blocks_override=2 blocks of 16 hold 32 "
                       r"tokens but max_model_len=64 needs 64: raise num_gpu_blocks_override "
                       r"to at least 4, or lower max_model_len") as refused:
        plan_blocks(4 * GiB, 0.9, 0, 0, MiB, 16, 64, num_blocks_override=2)
    assert "gpu_memory_utilization" not in str(refused.value)


def test_state_slots_come_out_of_the_budget_and_cap_max_num_seqs():
    """512 MiB: one 1024-token sequence's 64 blocks of 1 MiB are kept for the blocks, the
    rest holds 112 slots of 4 MiB (of max_num_seqs=1000); the blocks get what is left."""
    plan = plan_blocks(GiB, 0.5, 0, 0, MiB, 16, 1024, bytes_per_state_slot=4 * MiB,
                       max_num_seqs=1000)
    assert plan.num_state_slots == 112
    assert plan.num_blocks == 64
    assert "state slots: 112 x 4194304 bytes = 0.438 GiB" in plan.describe()
    assert "max_num_seqs=1000 capped: the slots allow 112 running sequences" in plan.describe()
    roomy = plan_blocks(GiB, 0.5, 0, 0, MiB, 16, 1024, bytes_per_state_slot=4 * MiB,
                        max_num_seqs=8)
    assert (roomy.num_state_slots, roomy.num_blocks) == (8, 512 - 32)
    assert "capped" not in roomy.describe()


def test_a_budget_without_room_for_one_sequences_slot_and_blocks_fails_with_the_numbers():
    with pytest.raises(ValueError) as error:
        plan_blocks(GiB, 0.5, 0, 0, MiB, 16, 1024, bytes_per_state_slot=449 * MiB,
                    max_num_seqs=8)
    message = str(error.value)
    assert "one sequence needs 67108864 bytes of KV blocks (max_model_len=1024)" in message
    assert f"plus a {449 * MiB}-byte state slot" in message
    assert f"the budget holds {512 * MiB} bytes" in message


# ---- the engine's own plan -------------------------------------------------------------
def test_engine_sizes_its_pool_from_measured_weights_and_activations(make_engine, tiny_model):
    engine = make_engine("llama", block_size=16)
    plan = engine.memory_plan
    hf_model = tiny_model("llama").hf_model
    config = hf_model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert plan.weight_bytes == sum(p.numel() * 4 for p in hf_model.parameters())
    assert plan.bytes_per_block == (2 * config.num_hidden_layers * 16
                                    * config.num_key_value_heads * head_dim * 4)
    assert plan.peak_activation_bytes > 0
    assert plan.device_memory_bytes == int(0.05 * GiB)
    budget = int(plan.device_memory_bytes * 0.9) - plan.weight_bytes - plan.peak_activation_bytes
    assert plan.num_blocks == budget // plan.bytes_per_block

    # The pool and the KV tensors have exactly that many blocks, zero-initialised.
    assert engine.kv_cache.pool.num_blocks == plan.num_blocks
    kv = engine.runner.kv_cache
    assert kv.shape == (2, config.num_hidden_layers, plan.num_blocks, 16,
                        config.num_key_value_heads, head_dim)
    assert kv.dtype == torch.float32
    assert not kv.any()


def test_lower_utilization_gives_fewer_blocks(make_engine):
    full = make_engine("llama", gpu_memory_utilization=0.9).memory_plan.num_blocks
    half = make_engine("llama", gpu_memory_utilization=0.45).memory_plan.num_blocks
    assert 0 < half < full


def test_num_gpu_blocks_override_sets_the_pool_size(make_engine):
    engine = make_engine("llama", num_gpu_blocks_override=40, block_size=8)
    assert engine.memory_plan.num_blocks == engine.kv_cache.pool.num_blocks == 40
    assert engine.runner.kv_cache.shape[2] == 40



def test_an_engine_whose_runner_a_later_engine_took_refuses_to_step(make_engine):
    """A runner holds one engine's KV cache: an older engine stepping on would read and
    write the newer one's blocks (bench/kv_dtype.py once timed one cache for three
    kv_cache_dtypes that way), so it stops with the cause named; the newer one serves."""
    old = make_engine("llama", num_gpu_blocks_override=40)
    old.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    new = make_engine("llama", num_gpu_blocks_override=40, kv_cache_dtype="int8")
    with pytest.raises(RuntimeError, match="another EngineCore was built on its model runner"):
        old.step()
    new.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    while new.has_unfinished_requests():
        new.step()

def test_engine_refuses_to_start_when_max_model_len_does_not_fit(make_engine):
    with pytest.raises(ValueError, match=r"holds \d+ tokens.*max_model_len=256"):
        make_engine("llama", gpu_memory_utilization=0.01, max_num_batched_tokens=256)


# ---- the profiling result, remembered across starts -----------------------------------
def test_a_repeated_start_reads_the_profiled_peak_instead_of_profiling(tiny_model, tmp_path,
                                                                      monkeypatch, caplog):
    monkeypatch.setenv("KVSCOPE_PROFILE_CACHE", str(tmp_path))
    config = EngineConfig(model=str(tiny_model("llama").path), dtype="float32", device="cpu",
                          device_memory_gb=0.05).resolved(TINY_MAX_POSITIONS)
    first = ModelRunner(config).plan_memory(config)
    assert len(list(tmp_path.glob("*.json"))) == 1

    again = ModelRunner(config)
    monkeypatch.setattr(again, "profile_peak_activations",
                        lambda *shape: pytest.fail("profiled although the peak was cached"))
    with caplog.at_level("INFO", logger="kvscope.engine.worker.profile_cache"):
        assert again.plan_memory(config) == first
    assert "reused the profiled activation peak" in caplog.text


def test_another_budget_or_a_damaged_cache_file_profiles_afresh(tiny_model, tmp_path,
                                                                monkeypatch):
    monkeypatch.setenv("KVSCOPE_PROFILE_CACHE", str(tmp_path))
    config = EngineConfig(model=str(tiny_model("llama").path), dtype="float32", device="cpu",
                          device_memory_gb=0.05).resolved(TINY_MAX_POSITIONS)
    small = ModelRunner(config).plan_memory(config)
    bigger = config.with_changes(max_num_batched_tokens=2 * config.max_num_batched_tokens)
    assert ModelRunner(config).plan_memory(bigger).peak_activation_bytes > \
        small.peak_activation_bytes
    assert len(list(tmp_path.glob("*.json"))) == 2

    for path in tmp_path.glob("*.json"):
        path.write_text("{not json")
    assert ModelRunner(config).plan_memory(config) == small  # profiled again, same answer
    rewritten = [p for p in tmp_path.glob("*.json") if p.read_text() != "{not json"]
    assert json.loads(rewritten[0].read_text())["peak_activation_bytes"] == \
        small.peak_activation_bytes


def test_the_cache_key_names_model_files_shapes_code_and_libraries(tiny_model):
    key = profile_key(tiny_model("llama").path, torch.float32, torch.device("cpu"), "torch",
                      {"num_tokens": 64})
    assert {"model", "model_files", "dtype", "device", "device_name", "code",
            "attention_backend", "num_tokens"} <= set(key)
    assert key["libraries"]["torch"].split("+")[0] == torch.__version__.split("+")[0]


def test_profiling_writes_no_usdt_lines(capfd):
    measure_peak_bytes(lambda: torch.ones(1000) + 1, torch.device("cpu"))
    assert "USDT" not in capfd.readouterr().err


def test_a_cpu_profile_reads_the_same_after_an_earlier_one_left_memory_counted():
    """The profiler's CPU total is process-wide and never forgets a tensor allocated inside
    one profile and freed outside it; every later profile must still read its own peak
    (each reconfigure profiles again in the same process)."""
    cpu = torch.device("cpu")
    kept = []

    def forward() -> None:
        first = torch.empty(1 << 20)
        torch.empty(1 << 18)
        del first

    alone = measure_peak_bytes(forward, cpu)
    measure_peak_bytes(lambda: kept.append(torch.empty(1 << 22)), cpu)
    kept.clear()  # freed with no profile running: the total keeps counting it
    assert alone == (1 << 20) * 4 + (1 << 18) * 4
    assert measure_peak_bytes(forward, cpu) == alone
