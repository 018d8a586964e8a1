"""Mixture-of-experts layers, shared by the families that have them (Qwen3-MoE, Qwen2-MoE,
OLMoE, Mixtral and gpt-oss in llama.py): a router picks each token's top-k experts once per layer,
and the experts run as one kernel op over the step's tokens (KernelOps.moe_experts), which
groups the tokens by expert so each chosen expert's weights are read once per step.

Every expert's gate/up projection is one stacked linear of experts * 2 * width rows, and
its down projection another of experts * hidden rows: the checkpoint's tensors (fused 3-D
ones as transformers 5 holds them, or the hub's per-expert ones) load into their rows,
and `--quantization int4|int8` packs them like any linear (quantized.py's quantize_model
swaps every nn.Linear), so one expert is a run of rows of a packed linear. A GGUF file's
experts (`quantization="gguf"`: one 3-D tensor per part, ffn_{gate,up,down}_exps) stay the
file's blocks in a GgufLinear of those rows, which the experts op slices per expert.

What a layer does beyond that is read from the config (MoeConfig), so another family (or
gpt-oss's router bias, expert biases and activation) is a new reading of a config, not a
new layer.
"""

import re
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from kvscope.engine.worker.models.bound_ops import UsesKernelOps
from kvscope.engine.worker.models.layers import LoadsOwnTensors
from kvscope.engine.worker.models.quantized import (
    GgufBlocks,
    GgufLinear,
    GroupQuantized,
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    dense,
    kernel_max_rows,
)
from kvscope.kernels import EXPERT_ACTIVATIONS, ExpertWeights, mxfp4
from kvscope.kernels.kernel_ops import SWIGLU_ALPHA, SWIGLU_LIMIT

# The architectures whose MoE layers this module reads from their configs, and the config
# field each keeps its expert count, expert width and top-k renormalization in (Mixtral
# always renormalizes).
MOE_MODEL_TYPES = {
    "qwen3_moe": ("num_experts", "moe_intermediate_size", "norm_topk_prob"),
    "qwen2_moe": ("num_experts", "moe_intermediate_size", "norm_topk_prob"),
    # Qwen3.5-MoE (text): a shared expert as Qwen2-MoE's, the top-k always renormalized
    "qwen3_5_moe_text": ("num_experts", "moe_intermediate_size", None),
    "olmoe": ("num_experts", "intermediate_size", "norm_topk_prob"),
    "mixtral": ("num_local_experts", "intermediate_size", None),
    # gpt-oss: a softmax over its top-k logits, which is the full softmax's top-k renormalized
    "gpt_oss": ("num_local_experts", "intermediate_size", None),
}
# Config fields of MoE designs these layers do not implement, with the values under which
# they change nothing: another scoring function or top-k method (DeepSeek's), grouped
# routing, scaled routing weights, shared experts counted DeepSeek's way, expert parallelism.
UNSUPPORTED_MOE_FIELDS = {
    "scoring_func": (None, "softmax"),
    "topk_method": (None, "greedy"),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "routed_scaling_factor": (None, 1.0),
    "n_shared_experts": (None, 0),
    "ep_size": (None, 1),
    "moe_layer_freq": (None, 1),
    "first_k_dense_replace": (None, 0),
    "clip_qkv": (None,),
}
# Checkpoint names some families use for the same modules (Mixtral's hub layout, gpt-oss's
# router).
CHECKPOINT_RENAMES = (("block_sparse_moe.", "mlp."), ("mlp.router.", "mlp.gate."))


@dataclass(frozen=True)
class MoeConfig:
    """One MoE layer's shape and routing, read from a transformers config (moe_config)."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int  # each expert's width
    normalize_top_k: bool  # the top-k probabilities rescaled to sum to 1
    # The routing weights rounded to the activations' dtype before they scale the experts'
    # outputs (Qwen, OLMoE), or kept in fp32 (Mixtral).
    round_weights: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"  # kernel_ops.EXPERT_ACTIVATIONS
    shared_expert_size: int = 0  # Qwen2-MoE: a dense MLP of this width behind a sigmoid gate
    # gpt-oss's fused checkpoint tensors: dense ones [experts, in, out] (transposed), and each
    # expert's gate and up outputs interleaved (gate 0, up 0, gate 1, ...), MXFP4 ones too
    gpt_oss_layout: bool = False
    mxfp4: bool = False  # the experts ship as MXFP4 blocks (quant_method mxfp4), kept so


def expert_count(config: PretrainedConfig) -> int:
    """The config's number of routed experts (0 for a dense model)."""
    fields = MOE_MODEL_TYPES.get(config.model_type)
    names = (fields[0],) if fields else ("num_experts", "num_local_experts", "n_routed_experts")
    return max((getattr(config, name, None) or 0) for name in names)


def moe_config(config: PretrainedConfig) -> MoeConfig | None:
    """The config's MoE layer (None for a dense model), or a ValueError naming the field
    these layers cannot follow and what they support."""
    experts = expert_count(config)
    if experts <= 1:
        return None
    if config.model_type not in MOE_MODEL_TYPES:
        raise ValueError(f"model: mixture-of-experts layers of model_type {config.model_type!r} "
                         f"are not supported; supported: {sorted(MOE_MODEL_TYPES)}")
    for field, neutral in UNSUPPORTED_MOE_FIELDS.items():
        value = getattr(config, field, None)
        if value not in neutral:
            raise ValueError(f"model: {field}={value!r} is not supported by the "
                             f"mixture-of-experts layers; supported: {list(neutral)}")
    _, width_field, normalize_field = MOE_MODEL_TYPES[config.model_type]
    top_k = config.num_experts_per_tok
    if not 1 <= top_k <= experts:
        raise ValueError(f"model: num_experts_per_tok={top_k} must be between 1 and the "
                         f"{experts} experts")
    gpt_oss = config.model_type == "gpt_oss"
    activation = "swigluoai" if gpt_oss else getattr(config, "hidden_act", "silu")
    if gpt_oss:
        for field, value in (("swiglu_alpha", SWIGLU_ALPHA), ("swiglu_limit", SWIGLU_LIMIT)):
            if getattr(config, field, value) != value:
                raise ValueError(f"model: {field}={getattr(config, field)!r} is not supported by "
                                 f"the experts' swigluoai; supported: [{value}]")
    quantization = getattr(config, "quantization_config", None) or {}
    method = (quantization if isinstance(quantization, dict) else vars(quantization)).get(
        "quant_method")
    if method is not None and not (gpt_oss and method == "mxfp4"):
        raise ValueError(f"model: quantization_config.quant_method={method!r} is not supported "
                         "for mixture-of-experts layers; supported: mxfp4 (gpt-oss's experts)")
    if activation not in EXPERT_ACTIVATIONS:
        raise ValueError(f"model: hidden_act {activation!r} is not supported by the experts; "
                         f"supported: {list(EXPERT_ACTIVATIONS)}")
    mixtral = config.model_type == "mixtral"
    return MoeConfig(
        num_experts=experts, top_k=top_k, hidden_size=config.hidden_size,
        intermediate_size=getattr(config, width_field),
        normalize_top_k=True if normalize_field is None else bool(getattr(config, normalize_field)),
        round_weights=not mixtral, activation=activation,
        shared_expert_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
        router_bias=gpt_oss, expert_bias=gpt_oss, gpt_oss_layout=gpt_oss,
        mxfp4=method == "mxfp4")


def sparse_layers(config: PretrainedConfig) -> list[bool]:
    """Which decoder layers are MoE layers: every one, but for Qwen's mlp_only_layers and
    those decoder_sparse_step skips (transformers' rule)."""
    if moe_config(config) is None:
        return [False] * config.num_hidden_layers
    dense_only = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return [index not in dense_only and (index + 1) % step == 0
            for index in range(config.num_hidden_layers)]


class TopKRouter(UsesKernelOps):
    """Each token's top-k experts and their weights: the softmax over every expert's logit,
    its k largest, renormalized where the config says so (transformers' TopKRouter). Not an
    nn.Linear, so quantization leaves it as the checkpoint has it: its choice is discrete."""

    def __init__(self, moe: MoeConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, moe.hidden_size))
        self.bias = nn.Parameter(torch.empty(moe.num_experts)) if moe.router_bias else None

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32 [tokens, k], expert ids int64 [tokens, k])."""
        logits = self.ops.linear(hidden, self.weight, self.bias)
        probabilities = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probabilities, self.moe.top_k, dim=-1)
        if self.moe.normalize_top_k:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.moe.round_weights:
            weights = weights.to(hidden.dtype).float()
        return weights, ids


class ExpertsLinear(nn.Linear):
    """One projection of every expert as the rows of one linear ([experts * out, in]), so
    quantize_model packs experts as it packs any linear. Never called as a linear: the
    Experts module hands its rows to the experts op."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, num_experts * out_features, bias=bias)
        self.num_experts = num_experts

    def reset_parameters(self) -> None:
        """No random start: every expert's rows come from the checkpoint (Experts checks
        that each was set)."""


class Mxfp4ExpertsLinear(nn.Module):
    """ExpertsLinear's rows kept in MXFP4 as gpt-oss ships them (kernels/mxfp4.py): `weight`
    the blocks uint8 [experts * out, in / 32, 16], `scales` uint8 [experts * out, in / 32],
    never widened in memory (the experts op streams them, or de-quantizes one expert's for
    a GEMM of many rows)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        mxfp4.check(torch.empty(0, in_features // mxfp4.GROUP, mxfp4.GROUP_BYTES, dtype=torch.uint8),
                    torch.empty(0, in_features // mxfp4.GROUP, dtype=torch.uint8), in_features,
                    "model: an expert projection")
        self.num_experts, self.in_features = num_experts, in_features
        self.out_features = num_experts * out_features
        groups = in_features // mxfp4.GROUP
        self.weight = nn.Parameter(torch.zeros(self.out_features, groups, mxfp4.GROUP_BYTES,
                                               dtype=torch.uint8), requires_grad=False)
        self.scales = nn.Parameter(torch.zeros(self.out_features, groups, dtype=torch.uint8),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None


# A per-expert checkpoint tensor's projection by its module name (the hub's names, and
# Mixtral's w1 / w3 / w2), and which half of gate_up it fills (None: all of down).
EXPERT_PARTS = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0),
                "up_proj": ("gate_up_proj", 1), "w3": ("gate_up_proj", 1),
                "down_proj": ("down_proj", None), "w2": ("down_proj", None)}
# Each part's hub name, which the loading bookkeeping (and its errors) use.
HUB_NAMES = {("gate_up_proj", 0): "gate_proj", ("gate_up_proj", 1): "up_proj",
             ("down_proj", None): "down_proj"}
_PER_EXPERT = re.compile(r"(\d+)\.(\w+)\.(weight|bias)")
# One part of every expert, [experts, out, in] (a GGUF file's ffn_{gate,up,down}_exps).
_EVERY_EXPERT = re.compile(r"(gate_proj|up_proj|down_proj)\.weight")
_FUSED = re.compile(r"(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")


class Experts(UsesKernelOps, LoadsOwnTensors):
    """Every routed expert of one layer: gate_up_proj rows [experts * 2 * width, hidden] (each
    expert's gate rows, then its up rows) and down_proj rows [experts * hidden, width]."""

    def __init__(self, moe: MoeConfig) -> None:
        super().__init__()
        self.moe = moe
        linear = Mxfp4ExpertsLinear if moe.mxfp4 else ExpertsLinear
        self.gate_up_proj = linear(moe.num_experts, moe.hidden_size, 2 * moe.intermediate_size,
                                   moe.expert_bias)
        self.down_proj = linear(moe.num_experts, moe.intermediate_size, moe.hidden_size,
                                moe.expert_bias)
        self.loaded: set[str] = set()
        # Where the latest forward's tokens per expert go: a row of the model runner's
        # expert_tokens (record_expert_tokens); None: not kept.
        self.token_counts: torch.Tensor | None = None

    # ---- loading -----------------------------------------------------------------------
    def load_tensor(self, name: str, tensor, checkpoint_name: str) -> None:
        """A checkpoint tensor under this module (`name` relative to it): fused
        (gate_up_proj [experts, 2 * width, hidden], down_proj, their _bias), one part of
        every expert (gate_proj.weight [experts, width, hidden], as GGUF blocks too) or one
        expert's (3.gate_proj.weight, 3.w2.weight ...)."""
        fused, per_expert = _FUSED.fullmatch(name), _PER_EXPERT.fullmatch(name)
        experts, width, hidden = (self.moe.num_experts, self.moe.intermediate_size,
                                  self.moe.hidden_size)
        if every_expert := _EVERY_EXPERT.fullmatch(name):
            projection, half = EXPERT_PARTS[every_expert.group(1)]
            out, into = (width, hidden) if projection == "gate_up_proj" else (hidden, width)
            if checkpoint_rows(tensor) != (experts * out, into):
                raise ValueError(
                    f"model: checkpoint tensor {checkpoint_name!r} has "
                    f"{list(checkpoint_rows(tensor))} rows x inputs, but the config "
                    f"(num_experts={experts}, hidden_size={hidden}, expert width {width}) makes "
                    f"it [{experts} x {out}, {into}]")
            rows_per_expert = 2 * width if projection == "gate_up_proj" else hidden
            for index in range(experts):
                start = index * rows_per_expert + (half or 0) * width
                self._stage(projection, slice(start, start + out), "weight",
                            checkpoint_row_slice(tensor, index * out, (index + 1) * out))
                self.loaded.add(f"{index}.{HUB_NAMES[projection, half]}.weight")
            return
        if fused:
            projection, suffix = fused.group(1), fused.group(2) or ""
            kind = {"": "weight", "_bias": "bias", "_blocks": "weight", "_scales": "scales"}[suffix]
            if suffix != "_bias" and (suffix in ("_blocks", "_scales")) != self.moe.mxfp4:
                raise ValueError(f"model: checkpoint tensor {checkpoint_name!r} "
                                 f"{'is' if suffix else 'is not'} MXFP4, but the config's "
                                 "quantization_config.quant_method says "
                                 f"{'mxfp4' if self.moe.mxfp4 else 'none'}")
            out, into = (2 * width, hidden) if projection == "gate_up_proj" else (hidden, width)
            if suffix == "_bias":
                expected = (experts, out)
            elif suffix == "_blocks":
                expected = (experts, out, into // mxfp4.GROUP, mxfp4.GROUP_BYTES)
            elif suffix == "_scales":
                expected = (experts, out, into // mxfp4.GROUP)
            else:  # gpt-oss's dense experts are [experts, in, out]
                expected = (experts, into, out) if self.moe.gpt_oss_layout else (experts, out, into)
            self._check_shape(checkpoint_name, tensor, expected)
            value = dense(tensor)
            if self.moe.gpt_oss_layout:
                value = gpt_oss_rows(value, projection, transposed=suffix == "")
            self._stage(projection, slice(None), kind, value)
            self.loaded.update(f"{index}.{HUB_NAMES[part]}.{kind}"
                               for index in range(experts) for part in HUB_NAMES
                               if part[0] == projection)
            return
        if per_expert is None or per_expert.group(2) not in EXPERT_PARTS:
            raise ValueError(f"model: checkpoint tensor {checkpoint_name!r} has no place in the "
                             "experts")
        index, leaf, kind = int(per_expert.group(1)), per_expert.group(2), per_expert.group(3)
        if index >= experts:
            raise ValueError(f"model: checkpoint tensor {checkpoint_name!r} is expert {index}, but the "
                             f"config has {experts} experts (num_experts)")
        projection, half = EXPERT_PARTS[leaf]
        out, into = (width, hidden) if projection == "gate_up_proj" else (hidden, width)
        self._check_shape(checkpoint_name, tensor, (out,) if kind == "bias" else (out, into))
        rows_per_expert = 2 * width if projection == "gate_up_proj" else hidden
        start = index * rows_per_expert + (half or 0) * width
        self._stage(projection, slice(start, start + out), kind, dense(tensor))
        self.loaded.add(f"{index}.{HUB_NAMES[projection, half]}.{kind}")

    def _check_shape(self, name: str, tensor, expected: tuple[int, ...]) -> None:
        shape = tuple(dense(tensor).shape)
        if shape != expected:
            raise ValueError(
                f"model: checkpoint tensor {name!r} has shape {list(shape)}, but the config "
                f"(num_experts={self.moe.num_experts}, hidden_size={self.moe.hidden_size}, "
                f"expert width {self.moe.intermediate_size}) makes it {list(expected)}")

    def _stage(self, projection: str, rows: slice, kind: str, value: torch.Tensor) -> None:
        """Rows of a projection (every expert's, for slice(None)) into its dense weight, its
        MXFP4 blocks or scales, or the quantized linear's staging (which quantizes them)."""
        linear = getattr(self, projection)
        rows = slice(0, linear.out_features) if rows == slice(None) else rows
        if kind == "bias":
            linear.bias.data[rows].copy_(value.reshape(-1))
        elif isinstance(linear, Mxfp4ExpertsLinear):
            target = linear.scales if kind == "scales" else linear.weight
            target.data[rows].copy_(value.reshape(-1, *target.shape[1:]))
        elif isinstance(linear, QuantizedLinear):  # GGUF blocks staged as they are
            linear.stage_rows(rows, value.reshape(-1, value.shape[-1])
                              if isinstance(value, torch.Tensor) else value)
        else:
            value = dense(value)
            linear.weight.data[rows].copy_(value.reshape(-1, value.shape[-1]))

    def unloaded(self) -> list[str]:
        """The experts' parts the checkpoint has not set, by their hub names."""
        kinds = ("weight",) + (("scales",) if self.moe.mxfp4 else ()) + (
            ("bias",) if self.moe.expert_bias else ())
        return [name for index in range(self.moe.num_experts) for part in HUB_NAMES.values()
                for kind in kinds if (name := f"{index}.{part}.{kind}") not in self.loaded]

    def bytes_per_expert(self) -> int:
        """One expert's share of the weights as stored (dense or packed, biases included):
        what a token that routes to it reads."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        return total // self.moe.num_experts

    # ---- running -----------------------------------------------------------------------
    def expert_weights(self, projection: str, dtype: torch.dtype) -> ExpertWeights:
        """A projection's rows as the experts op takes them: dense, packed (where the bound
        kernels have packed ones), or de-quantized (where they do not)."""
        linear = getattr(self, projection)
        experts = self.moe.num_experts
        bias = None if linear.bias is None else linear.bias.view(experts, -1)
        packed = self.ops.packed
        if isinstance(linear, Mxfp4ExpertsLinear):
            blocks = linear.weight.view(experts, -1, *linear.weight.shape[1:])
            scales = linear.scales.view(experts, -1, linear.scales.shape[-1])
            if packed is None:  # the plain-torch kernels take dense experts
                return ExpertWeights(mxfp4.dequantize(blocks, scales, dtype), bias)
            return ExpertWeights(blocks, bias, scales)
        if not isinstance(linear, QuantizedLinear):
            return ExpertWeights(linear.weight.view(experts, -1, linear.in_features), bias)
        if isinstance(linear, GgufLinear) and packed is not None:
            return ExpertWeights(linear.parts_table(), linear.bias, gguf=tuple(linear.weights),
                                 experts=experts)
        if packed is None:
            return ExpertWeights(linear.dequantized_weight(dtype).view(experts, -1,
                                                                       linear.in_features), bias)
        weight = linear.weight.view(experts, -1, linear.weight.shape[-1])
        scales = linear.scales.view(experts, -1, *linear.scales.shape[1:])
        if isinstance(linear, Int4Linear):
            return ExpertWeights(weight, bias, scales,
                                 linear.offsets.view(experts, -1, linear.offsets.shape[-1]),
                                 linear.group_size)
        if isinstance(linear, Int8Linear):
            return ExpertWeights(weight, bias, scales)
        raise ValueError(f"model: experts packed as {type(linear).__name__} are not supported; "
                         "supported: dense, int4, int8, gguf")

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        packed = self.ops.packed
        if packed is None:
            max_rows = 0
        elif isinstance(self.gate_up_proj, GgufLinear):  # the model's one limit (GgufLinear)
            max_rows = self.gate_up_proj.stream_rows(packed, hidden.dtype)
        else:
            max_rows = kernel_max_rows(packed, hidden.dtype)
        return self.ops.moe_experts(hidden, ids, weights,
                                    self.expert_weights("gate_up_proj", hidden.dtype),
                                    self.expert_weights("down_proj", hidden.dtype),
                                    self.moe.activation, max_rows, self.token_counts)


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP as a mixture of experts: the router (named `gate`, as in
    transformers), the routed experts, and where the model has one a shared expert whose
    output joins theirs scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE)."""

    def __init__(self, moe: MoeConfig, shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None) -> None:
        super().__init__()
        self.gate = TopKRouter(moe)
        self.experts = Experts(moe)
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(hidden)
        out = self.experts(hidden, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return out


def record_expert_tokens(model: nn.Module) -> torch.Tensor:
    """int64 [MoE layers, experts] that every forward overwrites with how many of its tokens
    each layer's experts took (each row sums to tokens x top_k): the routing's own counts,
    kept where telemetry can read them after a step at no cost to the step. [0, 0] for a
    dense model."""
    layers = [module for module in model.modules() if isinstance(module, Experts)]
    counts = torch.zeros(len(layers), layers[0].moe.num_experts if layers else 0,
                         dtype=torch.int64)
    for row, experts in zip(counts, layers):
        experts.token_counts = row
    return counts


@dataclass(frozen=True)
class ExpertLayout:
    """A MoE model's experts as telemetry reads them: which decoder layer each row of the
    runner's expert_tokens is, and what one expert of that layer reads (its weights as
    stored), so a step's counts tell the bytes its chosen experts read."""

    layers: tuple[int, ...]  # each MoE layer's decoder layer index, in expert_tokens' order
    num_experts: int
    top_k: int
    bytes_per_expert: tuple[int, ...]  # one per MoE layer


def expert_layout(model: nn.Module, config: PretrainedConfig) -> ExpertLayout | None:
    """The model's ExpertLayout; None for a dense model."""
    moe = moe_config(config)
    if moe is None:
        return None
    experts = [module for module in model.modules() if isinstance(module, Experts)]
    return ExpertLayout(
        tuple(index for index, sparse in enumerate(sparse_layers(config)) if sparse),
        moe.num_experts, moe.top_k, tuple(layer.bytes_per_expert() for layer in experts))


def checkpoint_rows(tensor) -> tuple[int, int]:
    """(rows, inputs) of a checkpoint tensor whose leading dimensions flatten into rows,
    whatever form it arrived in (GGUF blocks are not de-quantized to tell)."""
    if isinstance(tensor, GgufBlocks):
        return tensor.data.shape[0], tensor.in_features
    if isinstance(tensor, GroupQuantized):
        return tuple(tensor.q.shape)
    return tensor[..., 0].numel(), tensor.shape[-1]


def checkpoint_row_slice(tensor, start: int, stop: int):
    """Rows start:stop of a checkpoint tensor (checkpoint_rows' rows), in the form it
    arrived in."""
    if isinstance(tensor, GgufBlocks):
        return GgufBlocks(tensor.kind, tensor.data[start:stop], tensor.in_features)
    if isinstance(tensor, GroupQuantized):
        offset = None if tensor.offset is None else tensor.offset[start:stop]
        return GroupQuantized(tensor.q[start:stop], tensor.scale[start:stop], offset,
                              tensor.group_size, tensor.bits)
    return tensor.reshape(-1, tensor.shape[-1])[start:stop]


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name as these modules name it (CHECKPOINT_RENAMES)."""
    for old, new in CHECKPOINT_RENAMES:
        name = name.replace(old, new)
    return name


def gpt_oss_rows(value: torch.Tensor, projection: str, transposed: bool) -> torch.Tensor:
    """gpt-oss's fused expert tensor as the stacked rows take it, [experts, out, ...]: a dense
    one transposed from [experts, in, out] first, and gate_up's interleaved gate and up
    outputs (gate 0, up 0, gate 1, ...) reordered into each expert's gate rows, then its up
    rows."""
    if transposed:
        value = value.transpose(1, 2)
    if projection != "gate_up_proj":
        return value
    experts, out, *rest = value.shape
    return value.reshape(experts, out // 2, 2, *rest).transpose(1, 2).reshape(experts, out, *rest)
