"""Mixture-of-experts models (Qwen3-MoE, OLMoE, Mixtral, Qwen2-MoE): greedy tokens equal
transformers', through the C++ decoder stack and the eager layers, chunked prefill, both
preemption modes, prefix caching and parallel samples; their weights as transformers 5
holds them (fused 3-D experts) and as the hub ships them (one tensor per expert, sharded);
the memory plan counts every expert; configs and checkpoints the layers cannot follow are
refused at load, naming the field."""

import random

import pytest
import torch
from conftest import (
    MOE_ARCHITECTURES,
    TINY_MAX_POSITIONS,
    TINY_VOCAB_SIZE,
    first_token_ids,
    greedy_expectations,
)
from safetensors.torch import save_file
from transformers import MixtralConfig, Qwen3MoeConfig

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.kv_groups import kv_cache_groups
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.model_runner import ModelRunner
from kvscope.engine.worker.models import MODEL_REGISTRY, model_class
from kvscope.engine.worker.models.attention import layer_windows
from kvscope.engine.worker.models.moe import MOE_MODEL_TYPES, SparseMoeBlock, sparse_layers

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _make_prompts() -> list[list[int]]:
    """A short prompt, one of a block, a long one and one sharing the long one's first 24
    tokens (a prefix-cache candidate)."""
    rng = random.Random(63)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, TINY_VOCAB_SIZE) for _ in range(n)]

    long_prompt = tokens(37)
    return [tokens(5), tokens(16), long_prompt, long_prompt[:24] + tokens(6)]


PROMPTS = _make_prompts()
PATHS = [pytest.param(arch, eager, id=f"{arch}-{'eager' if eager else 'stack'}")
         for arch in MOE_ARCHITECTURES for eager in (False, True)]


@pytest.fixture(scope="module")
def expected(tiny_model):
    """expected(arch): transformers' greedy continuation of every prompt (computed once)."""
    return greedy_expectations(tiny_model, PROMPTS, MAX_TOKENS)


def _engine(enforce_eager: bool, make_engine, eager_engine, arch: str, **knobs) -> EngineCore:
    return (eager_engine if enforce_eager else make_engine)(arch, **knobs)


@pytest.mark.parametrize(("arch", "enforce_eager"), PATHS)
def test_greedy_matches_transformers(arch, enforce_eager, make_engine, eager_engine, run_engine,
                                     expected, tiny_model):
    engine = _engine(enforce_eager, make_engine, eager_engine, arch, block_size=16)
    run = run_engine(engine, PROMPTS, GREEDY)

    assert engine.runner.fused_decoder_stack is not enforce_eager
    assert first_token_ids(run) == expected(arch)
    # The config's dense layers (mlp_only_layers, decoder_sparse_step) stay dense.
    layers = engine.runner.model.model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == sparse_layers(
        tiny_model(arch).hf_model.config)
    assert engine.kv_cache.pool.num_used_blocks == 0


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize(("arch", "enforce_eager"), PATHS)
def test_greedy_output_through_every_feature(arch, enforce_eager, preemption_mode, make_engine,
                                             eager_engine, run_engine, expected, tiny_model):
    """Chunked prefill (7 tokens a step, so experts see ragged groups of tokens), two greedy
    samples per prompt, a pool too small for the batch (preemption), prefix caching and a
    second pass: every sample equals transformers', and every block comes back."""
    # 12 blocks for each KV cache group (gpt-oss's windowed and full layers make two).
    groups = len(kv_cache_groups(layer_windows(tiny_model(arch).hf_model.config)))
    engine = _engine(enforce_eager, make_engine, eager_engine, arch, block_size=4,
                     num_gpu_blocks_override=12 * groups, max_model_len=48,
                     max_num_batched_tokens=7,
                     preemption_mode=preemption_mode, swap_space=0.01,
                     enable_prefix_caching=True)
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(2):
        run = run_engine(engine, PROMPTS, params)
        assert [[sample.token_ids for sample in output.outputs] for output in run.outputs] == [
            [tokens, tokens] for tokens in expected(arch)]
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.prefix_stats.hits > 0
    assert engine.kv_cache.pool.num_used_blocks == 0
    assert len(engine.kv_cache.free_swap_blocks) == engine.kv_cache.num_swap_blocks


@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen2-moe"])
def test_each_forward_records_its_tokens_per_expert(arch, make_engine, eager_engine, tiny_model,
                                                    run_engine):
    """The runner's expert_tokens [MoE layers, experts]: each row of a forward sums to its
    tokens x top_k, and the C++ stack counts what the eager layers count."""
    config = tiny_model(arch).hf_model.config
    counts = []
    for engine in (make_engine(arch), eager_engine(arch)):
        runner = engine.runner
        assert runner.expert_tokens.shape == (sum(sparse_layers(config)), 8)
        engine.add_request(PROMPTS[2], GREEDY)
        engine.step()  # the whole prompt in one forward
        assert runner.expert_tokens.sum(dim=1).tolist() == [
            len(PROMPTS[2]) * config.num_experts_per_tok] * runner.expert_tokens.shape[0]
        counts.append(runner.expert_tokens.clone())
        run_engine(engine, [], GREEDY)  # the request runs to its end
        assert runner.expert_tokens.sum(dim=1).tolist() == [config.num_experts_per_tok] * len(
            counts[-1])  # the last forward: one decode token
    assert torch.equal(counts[0], counts[1])


def test_the_torch_backend_runs_the_experts_through_the_oracle(tiny_model, monkeypatch,
                                                              run_engine, expected):
    """Where the C++ kernels do not run (CUDA, no compiler), reference.moe_experts does."""
    monkeypatch.setenv("KVSCOPE_ATTENTION_BACKEND", "torch")
    engine = _engine_on(tiny_model("qwen2-moe").path)
    assert engine.runner.kernel_ops.backend == "torch"
    assert first_token_ids(run_engine(engine, PROMPTS, GREEDY)) == expected("qwen2-moe")


def _copy_tokenizer(tiny, folder) -> None:
    for path in tiny.path.iterdir():
        if "token" in path.name:
            (folder / path.name).write_bytes(path.read_bytes())


def _engine_on(folder, **knobs) -> EngineCore:
    return EngineCore(EngineConfig(model=str(folder), dtype="float32", device="cpu",
                                   device_memory_gb=0.05, **knobs))


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
def test_fused_expert_tensors_as_transformers_holds_them_load(arch, tiny_model, tmp_path,
                                                              run_engine, expected):
    """transformers 5's own state dict (mlp.experts.gate_up_proj [experts, 2 * width, hidden],
    down_proj): the folder a conversion or an older save leaves."""
    tiny = tiny_model(arch)
    state = {name: tensor.contiguous() for name, tensor in tiny.hf_model.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    tiny.hf_model.config.save_pretrained(tmp_path)
    _copy_tokenizer(tiny, tmp_path)

    assert first_token_ids(run_engine(_engine_on(tmp_path), PROMPTS, GREEDY)) == expected(arch)


def test_sharded_per_expert_checkpoints_load(tiny_model, tmp_path, run_engine, expected):
    """The hub's layout (experts.N.gate_proj.weight ...), split over several shards."""
    tiny = tiny_model("olmoe")
    tiny.hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    _copy_tokenizer(tiny, tmp_path)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1

    assert first_token_ids(run_engine(_engine_on(tmp_path), PROMPTS, GREEDY)) == expected("olmoe")


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_the_memory_plan_counts_every_expert(arch, tiny_model):
    """Every expert's bytes are weights, though a step reads only its tokens' experts."""
    runner = ModelRunner(EngineConfig(model=str(tiny_model(arch).path), dtype="float32",
                                      device="cpu", device_memory_gb=0.05))
    hf_bytes = sum(p.numel() * p.element_size() for p in tiny_model(arch).hf_model.parameters())
    assert runner.weight_bytes == hf_bytes


SMALL = {"vocab_size": TINY_VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32,
         "max_position_embeddings": TINY_MAX_POSITIONS, "num_experts": 4,
         "num_experts_per_tok": 2}


@pytest.mark.parametrize(("change", "named"), [
    ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid' is not supported .*'softmax'"),
    ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc' is not supported .*'greedy'"),
    ({"n_group": 8}, "n_group=8 is not supported"),
    ({"ep_size": 4}, "ep_size=4 is not supported .*1"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 must be between 1 and the 4 experts"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported by the experts; supported: "),
])
def test_a_moe_config_the_layers_cannot_follow_is_refused_naming_the_field(change, named):
    config = Qwen3MoeConfig(**SMALL, architectures=["Qwen3MoeForCausalLM"])
    for field, value in change.items():
        setattr(config, field, value)
    with pytest.raises(ValueError, match=named):
        model_class(config)


def test_moe_layers_of_another_family_are_refused_listing_the_supported():
    config = MixtralConfig(**{**SMALL, "num_local_experts": 4}, architectures=["MixtralForCausalLM"])
    config.model_type = "deepseek_v3"
    with pytest.raises(ValueError, match="model_type 'deepseek_v3' are not supported") as refused:
        model_class(config)
    assert str(sorted(MOE_MODEL_TYPES)) in str(refused.value)
    assert {"Qwen3MoeForCausalLM", "OlmoeForCausalLM", "MixtralForCausalLM",
            "Qwen2MoeForCausalLM"} <= set(MODEL_REGISTRY)


@pytest.mark.parametrize(("mangle", "named"), [
    (lambda state: state.update({"model.layers.0.mlp.experts.1.up_proj.weight": torch.zeros(8, 64)}),
     r"'model.layers.0.mlp.experts.1.up_proj.weight' has shape \[8, 64\], .* makes it \[32, 64\]"),
    (lambda state: state.pop("model.layers.1.mlp.experts.3.down_proj.weight"),
     r"checkpoint lacks 1 tensors, e.g. \['model.layers.1.mlp.experts.3.down_proj.weight'\]"),
    (lambda state: state.update({"model.layers.0.mlp.experts.9.gate_proj.weight": torch.zeros(32, 64)}),
     r"'model.layers.0.mlp.experts.9.gate_proj.weight' is expert 9, but the config has 8"),
])
def test_an_expert_tensor_that_does_not_fit_the_config_is_refused_naming_it(
        mangle, named, tiny_model, tmp_path):
    tiny = tiny_model("olmoe")
    tiny.hf_model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    state = load_file(tmp_path / "model.safetensors")
    mangle(state)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _copy_tokenizer(tiny, tmp_path)
    with pytest.raises(ValueError, match=named):
        _engine_on(tmp_path)


def test_olmoe_q_k_norms_need_head_dim_times_heads_to_be_hidden_size():
    from transformers import OlmoeConfig

    from kvscope.engine.worker.models.llama import LlamaForCausalLM

    config = OlmoeConfig(**SMALL, head_dim=32)
    with pytest.raises(ValueError, match=r"head_dim=32 must be hidden_size / num_attention_heads "
                                         r"\(16\) for olmoe's q/k norms"):
        LlamaForCausalLM(config, 64, 64)
