"""The experts op of a mixture-of-experts layer (KernelOps.moe_experts): the C++ kernel over
dense, int4 and int8 experts against the plain-torch oracle (kernels/reference.py), its
tokens-per-expert counts, and a step reading only the experts its tokens chose."""

import copy

import pytest
import torch
from torch import nn

from kvscope.engine.worker.model_runner import default_dtype
from kvscope.engine.worker.models.bound_ops import bind_kernel_ops
from kvscope.engine.worker.models.moe import Experts, MoeConfig, TopKRouter
from kvscope.engine.worker.models.quantized import pack_model, quantize_model
from kvscope.kernels import cpu_kernels

CPU = torch.device("cpu")
MOE = MoeConfig(num_experts=8, top_k=3, hidden_size=64, intermediate_size=32,
                normalize_top_k=True, expert_bias=True)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def experts_module(quantization: str, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """A module holding one layer's experts, loaded with random fused tensors, packed."""
    generator = torch.Generator().manual_seed(seed)
    holder = nn.Module()
    with default_dtype(dtype):  # as the runner builds a model
        holder.experts = Experts(MOE)
        quantize_model(holder, quantization, 32)
    shapes = {"gate_up_proj": (8, 64, 64), "down_proj": (8, 64, 32),
              "gate_up_proj_bias": (8, 64), "down_proj_bias": (8, 64)}
    for name, shape in shapes.items():
        holder.experts.load_tensor(name, torch.randn(shape, generator=generator) * 0.3, name)
    assert holder.experts.unloaded() == []
    pack_model(holder, dtype, CPU)
    return holder.to(dtype) if quantization == "none" else holder


def routing(tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(MOE.num_experts, generator=generator)[:MOE.top_k]
                       for _ in range(tokens)])
    weights = torch.rand(tokens, MOE.top_k, generator=generator)
    return weights / weights.sum(-1, keepdim=True), ids


@torch.inference_mode()  # as the runner's forward
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", ["none", "int4", "int8"])
@pytest.mark.parametrize("tokens", [1, 9, 150])  # one stream; a batch; > 32 rows an expert
def test_the_cpu_experts_op_equals_the_plain_torch_oracle(tokens, quantization, dtype):
    """The C++ op (tokens grouped by expert, each expert's projections through the linear
    kernels: streamed, or past their rows a GEMM) against the oracle over the same
    de-quantized weights, expert by expert."""
    kernels = experts_module(quantization, dtype)
    oracle = copy.deepcopy(kernels)  # on TORCH_OPS: no packed kernels, the plain-torch twins
    bind_kernel_ops(kernels, cpu_kernels.kernel_ops())
    hidden = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    weights, ids = routing(tokens)

    for module in (kernels, oracle):  # each expert's tokens, counted by each op
        module.experts.token_counts = torch.full((MOE.num_experts,), -1)
    out = kernels.experts(hidden, weights, ids)
    expected = oracle.experts(hidden, weights, ids)
    assert torch.equal(kernels.experts.token_counts, oracle.experts.token_counts)
    assert kernels.experts.token_counts.sum() == tokens * MOE.top_k
    assert out.dtype == dtype and out.shape == hidden.shape
    error = (out.float() - expected.float()).abs().max().item()
    assert error <= TOLERANCE[dtype] * expected.float().abs().max().item()


@torch.inference_mode()
@pytest.mark.parametrize("quantization", ["none", "int4", "int8"])
def test_a_step_reads_only_the_experts_its_tokens_chose(quantization):
    """Every expert no token chose holds NaN: the output stays finite (its weights were never
    read), and equals the output with them intact."""
    module = experts_module(quantization, torch.float32)
    bind_kernel_ops(module, cpu_kernels.kernel_ops())
    hidden = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    weights, ids = routing(2)
    intact = module.experts(hidden, weights, ids)
    unchosen = sorted(set(range(MOE.num_experts)) - set(ids.flatten().tolist()))
    assert unchosen
    for linear in (module.experts.gate_up_proj, module.experts.down_proj):
        rows = linear.out_features // MOE.num_experts
        for parameter in (p for p in linear.parameters() if p.is_floating_point()):
            # packed weights are integers: their float16 / fp32 scales carry the NaN
            per_expert = parameter.data.view(MOE.num_experts, rows, -1)
            per_expert[unchosen] = float("nan")

    out = module.experts(hidden, weights, ids)
    assert torch.isfinite(out).all()
    assert torch.equal(out, intact)


@torch.inference_mode()
def test_the_op_refuses_an_expert_id_out_of_range():
    module = experts_module("none", torch.float32)
    bind_kernel_ops(module, cpu_kernels.kernel_ops())
    weights, ids = routing(1)
    ids[0, 0] = MOE.num_experts
    with pytest.raises(RuntimeError, match="expert id 8 out of range for 8 experts"):
        module.experts(torch.zeros(1, 64), weights, ids)


@torch.inference_mode()
def test_a_router_bias_shifts_the_logits_before_the_softmax():
    """gpt-oss's router has a bias: the choice and the weights follow logits + bias."""
    moe = MoeConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=4,
                    normalize_top_k=False, round_weights=False, router_bias=True)
    router = TopKRouter(moe)
    router.weight.data = torch.zeros(4, 8)
    router.bias.data = torch.tensor([0.0, 3.0, 1.0, 2.0])
    bind_kernel_ops(router, cpu_kernels.kernel_ops())
    weights, ids = router(torch.randn(3, 8))
    probabilities = torch.softmax(router.bias, dim=0)
    assert ids.tolist() == [[1, 3]] * 3
    torch.testing.assert_close(weights, probabilities[[1, 3]].expand(3, 2))
