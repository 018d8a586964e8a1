"""Weight-only quantization: int4 (grouped, scale and offset per group) and int8 (per output
channel) linears and embeddings that keep activations in the model's dtype.

A model is built dense, `quantize_model` swaps its linears and token embedding for empty
quantized twins, the weights are loaded into those (dense tensors are quantized as they
arrive; GGUF blocks of the same format are copied exactly), and `pack_model` converts them
into the layout of the C++ kernels (kernels/csrc/quantized/). Up to
`kernel_max_rows(packed, dtype)` rows of activations (decode steps) stream the packed weights
through those kernels; more rows are compute-bound and run a GEMM instead. Where the kernels do not
run (a backend without packed kernels: CUDA, no C++ compiler) the weights are de-quantized
on every forward.
"""

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvscope.engine.config import QUANTIZATION_GROUP_SIZES
from kvscope.engine.worker.models.bound_ops import UsesKernelOps
from kvscope.kernels import TORCH_OPS, PackedLinearKernels, gguf_blocks
from kvscope.kernels.gguf_lanes import (
    INT4_CHUNK,
    LANES,
    dequantize_lanes,
    int4_wide_blocks,
    lanes,
)

# Rows of activations the streaming kernels take; more go to a GEMM on the de-quantized
# weight. The exact kernels (fp32 activations, CPUs without VNNI) re-read the weights for
# every 8 rows, so they stop there. The VNNI kernels (bf16 activations rounded to int8) take
# any number of rows tile by tile, reading the weights once: on the Zen 4, whose bf16 GEMM
# has bf16 dot products, they beat de-quantize + GEMM up to 32 rows, not at 64
# (bench/quantized_linear.py; docs/performance-history.md, 'Figures the code's comments
# quoted'). Where bf16 GEMMs run widened to fp32 they match or beat it at every row count
# measured, up to 2,048 (docs/performance-history.md, 'Prefill through the int8 dots where
# bf16 GEMMs run widened').
KERNEL_MAX_ROWS = 8
TILED_KERNEL_MAX_ROWS = 32
# GGUF layers repacked into lanes (GgufLinear.repack) de-quantize more slowly than int4 and
# int8 do, so where those stop at TILED_KERNEL_MAX_ROWS the lanes keep streaming to here: on
# an AMX Xeon they stream faster than de-quantize + GEMM at 64 rows and no faster at 96,
# where int4 and int8 cross between 32 and 64 rows depending on the sitting
# (bench/stream_vs_gemm.py; docs/performance-history.md, 'De-quantizing lanes for a GEMM').
LANES_KERNEL_MAX_ROWS = 64


def kernel_max_rows(packed: PackedLinearKernels, dtype: torch.dtype) -> int:
    """The most rows of activations in `dtype` that stream through the packed kernels."""
    if dtype == torch.bfloat16 and packed.rounds_activations_to_int8:
        return sys.maxsize if packed.widens_bf16_gemms else TILED_KERNEL_MAX_ROWS
    return KERNEL_MAX_ROWS


@dataclass(frozen=True, slots=True)
class GroupQuantized:
    """Rows of a weight as `q * scale + offset`, one scale (and offset) per `group_size`
    consecutive input columns: the GGUF block formats Q4_0, Q4_1 and Q8_0."""

    q: torch.Tensor  # [rows, cols], integers (uint8 0..15 for 4 bits, int8 for 8 bits)
    scale: torch.Tensor  # [rows, cols // group_size], fp32
    offset: torch.Tensor | None  # like scale; None = symmetric
    group_size: int
    bits: int

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.q.shape
        grouped = self.q.float().view(rows, -1, self.group_size) * self.scale.unsqueeze(-1)
        if self.offset is not None:
            grouped = grouped + self.offset.unsqueeze(-1)
        return grouped.view(rows, cols)


@dataclass(frozen=True, slots=True)
class GgufBlocks:
    """Rows of a weight exactly as a GGUF file stores them: ggml blocks of one type
    (kernels/gguf_blocks.PACKED_TYPES), one row of blocks per output row."""

    kind: gguf_blocks.GGMLQuantizationType
    data: torch.Tensor  # uint8 [rows, row bytes]
    in_features: int

    def dequantize(self) -> torch.Tensor:
        return gguf_blocks.dequantize(self.data, self.kind, self.in_features)


def dense(tensor: "torch.Tensor | GroupQuantized | GgufBlocks") -> torch.Tensor:
    """A checkpoint tensor as a plain tensor, whatever form it arrived in."""
    return tensor.dequantize() if isinstance(tensor, GroupQuantized | GgufBlocks) else tensor


def quantize_int4(weight: torch.Tensor, group_size: int) -> GroupQuantized:
    """Asymmetric min/max int4 per group (llama.cpp's Q4_1 rule): q in 0..15, with the scale
    and offset rounded to the float16 they are stored in (the offset down and the scale up,
    so the group's range stays covered and no weight is off by more than half a step)."""
    rows, cols = weight.shape
    grouped = weight.float().view(rows, -1, group_size)
    low, high = grouped.amin(-1), grouped.amax(-1)
    low = float16_toward(low, float("-inf"))
    scale = float16_toward(((high - low) / 15).clamp(min=FLOAT16_SMALLEST), float("inf"))
    q = ((grouped - low.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15)
    return GroupQuantized(q.to(torch.uint8).view(rows, cols), scale, low, group_size, 4)


FLOAT16_SMALLEST = 2.0 ** -24  # the smallest positive (subnormal) float16


def float16_toward(values: torch.Tensor, bound: float) -> torch.Tensor:
    """fp32 values rounded to float16 in the direction of `bound` (as fp32 again)."""
    rounded = values.half()
    off = (rounded.float() - values) * (1 if bound > 0 else -1) < 0
    rounded = torch.where(off, torch.nextafter(rounded, torch.tensor(bound).half()), rounded)
    return rounded.float()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (q int8 [rows, cols], scale fp32 [rows])."""
    weight = weight.float()
    scale = (weight.abs().amax(-1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = (weight / scale.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def frozen(tensor: torch.Tensor) -> nn.Parameter:
    """Packed weights are parameters (so weight_bytes and .to() see them) that never train."""
    return nn.Parameter(tensor, requires_grad=False)


def part_rows(output_sizes: list[int], index: int | None) -> slice:
    """The rows of part `index` of a merged projection's outputs; None: every row."""
    if index is None:
        return slice(0, sum(output_sizes))
    start = sum(output_sizes[:index])
    return slice(start, start + output_sizes[index])


class QuantizedLinear(UsesKernelOps):
    """Base of the quantized twins of nn.Linear / MergedLinear: same in/out sizes, same
    `load_part` and `split`, weights staged in fp32-scaled integers until `pack`.

    Subclasses give `stream` (the bound packed kernel for a few rows), `dequantize` (the
    kernels' de-quantization for a GEMM over many) and `dequantized_weight`, their
    plain-torch twin (where the bound kernels have no packed ones, and the tests' oracle)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = output_sizes
        self.out_features = sum(output_sizes)
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None

    def load_part(self, param_name: str, index: int | None, tensor) -> None:
        """Part `index` of the merged rows, or all of them (None: a checkpoint that stores
        the parts fused, as Phi-3's qkv_proj)."""
        rows = part_rows(self.output_sizes, index)
        if param_name == "bias":
            self.bias.data[rows].copy_(dense(tensor))
        else:
            self.stage_rows(rows, tensor)

    def split(self, output: torch.Tensor) -> list[torch.Tensor]:
        return list(output.split(self.output_sizes, dim=-1))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ W.T + bias in x's dtype, widened to out_dtype (float32: logits) after."""
        flat = x.reshape(-1, self.in_features)
        if flat.stride(-1) != 1:  # the kernels take rows with contiguous features, strided
            flat = flat.contiguous()
        out_dtype = out_dtype or flat.dtype
        packed = self.ops.packed
        if packed is None:
            out = F.linear(flat, self.dequantized_weight(flat.dtype), self.bias).to(out_dtype)
        elif flat.shape[0] <= self.stream_rows(packed, flat.dtype):
            out = self.stream(packed, flat, out_dtype)
        else:  # the backend's GEMM (widened on CPUs without bf16 dot products)
            out = self.ops.linear(flat, self.dequantize(packed, flat.dtype), self.bias).to(out_dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def stream_rows(self, packed: PackedLinearKernels, dtype: torch.dtype) -> int:
        """The most rows of x that `stream` takes; more run a GEMM."""
        return kernel_max_rows(packed, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int4Linear(QuantizedLinear):
    """y = x @ (q * scale + offset).T with q int4 packed two to a byte (byte j of each
    32-input chunk holds weight j and weight j + 16, GGUF's order) and a float16 scale and
    offset per `group_size` inputs of each output row."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool,
                 group_size: int) -> None:
        super().__init__(in_features, output_sizes, bias)
        self.group_size = group_size
        groups = in_features // group_size
        staged = {"dtype": torch.float32, "device": "cpu"}  # not the model's default dtype
        self.staged_q = torch.zeros(self.out_features, in_features, dtype=torch.uint8,
                                    device="cpu")
        self.staged_scale = torch.zeros(self.out_features, groups, **staged)
        self.staged_offset = torch.zeros(self.out_features, groups, **staged)

    def stage_rows(self, rows: slice, tensor) -> None:
        matches = (isinstance(tensor, GroupQuantized) and tensor.bits == 4
                   and tensor.group_size == self.group_size and tensor.offset is not None)
        # Blocks of the same shape (GGUF Q4_0 / Q4_1 at group 32, whose scales are float16
        # already) copy exactly; anything else is re-quantized from its de-quantized values.
        blocks = tensor if matches else quantize_int4(dense(tensor), self.group_size)
        self.staged_q[rows] = blocks.q
        self.staged_scale[rows] = blocks.scale
        self.staged_offset[rows] = blocks.offset

    def pack(self, dtype: torch.dtype, device: torch.device) -> None:
        chunks = self.staged_q.view(self.out_features, -1, 2, INT4_CHUNK // 2)
        packed = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).view(self.out_features, -1)
        self.weight = frozen(int4_wide_blocks(packed).to(device))
        self.scales = frozen(self.staged_scale.to(device, torch.float16))
        self.offsets = frozen(self.staged_offset.to(device, torch.float16))
        del self.staged_q, self.staged_scale, self.staged_offset

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The plain-torch twin of the kernels' de-quantization (the fallback and the
        tests' oracle): the dense weight, computed in fp32 and rounded to `dtype`."""
        chunks = int4_wide_blocks(self.weight, inverse=True).view(self.out_features, -1,
                                                                 INT4_CHUNK // 2)
        q = torch.cat([chunks & 15, chunks >> 4], dim=-1).view(self.out_features, -1,
                                                               self.group_size)
        weight = q.float() * self.scales.float().unsqueeze(-1) + self.offsets.float().unsqueeze(-1)
        return weight.view(self.out_features, self.in_features).to(dtype)

    def stream(self, packed: PackedLinearKernels, flat: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
        # The output projections are int8 (quantize_model), so torch widens here.
        return packed.int4_linear(flat, self.weight, self.scales, self.offsets,
                                  self.group_size, self.bias).to(out_dtype)

    def dequantize(self, packed: PackedLinearKernels, dtype: torch.dtype) -> torch.Tensor:
        return packed.int4_dequantize(self.weight, self.scales, self.offsets, self.group_size,
                                      dtype)


class Int8Linear(QuantizedLinear):
    """y = x @ (q * scale).T with q int8 and one fp32 scale per output row."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, output_sizes, bias)
        self.staged_q = torch.zeros(self.out_features, in_features, dtype=torch.int8,
                                    device="cpu")
        self.staged_scale = torch.zeros(self.out_features, dtype=torch.float32, device="cpu")

    def stage_rows(self, rows: slice, tensor) -> None:
        # Per-row scales fit no GGUF block format, so every source is re-quantized.
        self.staged_q[rows], self.staged_scale[rows] = quantize_int8(dense(tensor))

    def pack(self, dtype: torch.dtype, device: torch.device) -> None:
        self.weight = frozen(self.staged_q.to(device))
        self.scales = frozen(self.staged_scale.to(device))
        del self.staged_q, self.staged_scale

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight, computed in fp32 and rounded to `dtype` (fallback and oracle)."""
        return (self.weight.float() * self.scales.unsqueeze(-1)).to(dtype)

    def stream(self, packed: PackedLinearKernels, flat: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
        return packed.int8_linear(flat, self.weight, self.scales, self.bias, out_dtype)

    def dequantize(self, packed: PackedLinearKernels, dtype: torch.dtype) -> torch.Tensor:
        return packed.int8_dequantize(self.weight, self.scales, dtype)


class EmbeddingRows:
    """A quantized linear's rows as a token embedding table: looking a token up
    de-quantizes its row (the subclass's `forward`), and `project` uses the same rows as a
    tied output projection (the logits). Mixed in before the linear it tables."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(embedding_dim, [num_embeddings], bias=False)

    def pack(self, dtype: torch.dtype, device: torch.device) -> None:
        super().pack(dtype, device)
        self.dtype = dtype

    def project(self, hidden: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return QuantizedLinear.forward(self, hidden, out_dtype)


class Int8Embedding(EmbeddingRows, Int8Linear):
    """A token embedding as int8 rows with one scale each."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.flatten()
        rows = self.weight.index_select(0, ids).float() * self.scales.index_select(0, ids)[:, None]
        return rows.to(self.dtype).view(*input_ids.shape, self.in_features)


@dataclass(frozen=True, slots=True)
class GgufPart:
    """Consecutive output rows of a GgufLinear held in one form: ggml blocks of `kind`, or
    dense (kind None) where the file stores them as F32 / F16 / BF16. `code` is the form
    the kernels read: ggml's type id, LANES[kind] where the rows were repacked at load
    (GgufLinear.repack), -1 for dense."""

    rows: slice
    kind: gguf_blocks.GGMLQuantizationType | None
    code: int

    def dequantize(self, weight: torch.Tensor, in_features: int) -> torch.Tensor:
        """The plain-torch de-quantization of this part's rows (fp32)."""
        if self.code in LANES.values():
            return dequantize_lanes(weight, self.kind, in_features)
        return gguf_blocks.dequantize(weight, self.kind, in_features)


class GgufLinear(QuantizedLinear):
    """y = x @ W.T + bias with W's rows as the GGUF file stores them (quantization="gguf").

    A merged projection's parts may come in different types (Q4_K_M keeps some layers'
    attn_v in Q6_K beside Q4_K q and k): each run of consecutive rows of one type is one
    weight tensor (`weights[i]`, described by `parts[i]`), and each writes its columns of
    the output. Rows stream through the blocks up to kernel_max_rows (see there), or
    LANES_KERNEL_MAX_ROWS where the whole model is held in lanes (repack_gguf sets
    `model_in_lanes`): one limit for every layer, as the decoder stack has one."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, output_sizes, bias)
        self.staged: list[tuple[slice, torch.Tensor | GgufBlocks]] = []
        self.model_in_lanes = False

    def stage_rows(self, rows: slice, tensor) -> None:
        self.staged.append((rows, tensor))

    def pack(self, dtype: torch.dtype, device: torch.device) -> None:
        staged = sorted(self.staged, key=lambda part: part[0].start)
        if [r.start for r, _ in staged] != [0] + [r.stop for r, _ in staged[:-1]] or (
                staged[-1][0].stop != self.out_features):
            raise ValueError(f"model: a GGUF layer's parts cover rows {[r for r, _ in staged]}"
                             f" of {self.out_features}")
        runs: list[tuple[slice, object, list]] = []  # consecutive parts of one type merge
        for rows, tensor in staged:
            kind = tensor.kind if isinstance(tensor, GgufBlocks) else None
            if runs and runs[-1][1] == kind:
                start, _, tensors = runs[-1]
                runs[-1] = (slice(start.start, rows.stop), kind, [*tensors, tensor])
            else:
                runs.append((rows, kind, [tensor]))
        self.parts = [GgufPart(rows, kind, -1 if kind is None else int(kind))
                      for rows, kind, _ in runs]
        self.weights = nn.ParameterList([frozen(
            torch.cat([t.data for t in tensors]).to(device) if kind is not None
            else torch.cat([dense(t) for t in tensors]).to(device, dtype))
            for _, kind, tensors in runs])
        del self.staged

    def repack(self, repacked_type: Callable[[int], int]) -> None:
        """Each run of blocks that the kernels stream faster repacked (repacked_type(type):
        the form's code, or -1) into that form, the same weights (`lanes`)."""
        for index, part in enumerate(self.parts):
            code = LANES.get(part.kind)
            if code is not None and repacked_type(int(part.kind)) == code:
                weight = self.weights[index]
                self.weights[index] = frozen(
                    lanes(weight, part.kind, self.in_features).to(weight.device))
                self.parts[index] = GgufPart(part.rows, part.kind, code)

    def parts_table(self) -> torch.Tensor:
        """The runs for the C++ kernels: (type code, first row, end row) per run, in the
        order of `weights`."""
        return torch.tensor([[part.code, part.rows.start, part.rows.stop] for part in self.parts],
                            dtype=torch.int64)

    def weight_bytes_by_type(self) -> dict[str, int]:
        """Each part's bytes under its GGUF type's name (dense parts: the model dtype's)."""
        totals: dict[str, int] = {}
        for part, weight in zip(self.parts, self.weights):
            name = part.kind.name if part.kind is not None else str(weight.dtype).removeprefix("torch.")
            totals[name] = totals.get(name, 0) + weight.numel() * weight.element_size()
        return totals

    def part_weight(self, index: int, dtype: torch.dtype, packed: PackedLinearKernels | None):
        """Part `index`'s dense weight in `dtype`: the kernels' de-quantization, else the
        plain-torch one (the torch and Triton backends)."""
        part, weight = self.parts[index], self.weights[index]
        if part.kind is None:
            return weight.to(dtype)
        if packed is None:
            return part.dequantize(weight, self.in_features).to(dtype)
        return packed.gguf_dequantize(weight, part.code, self.in_features, dtype)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([self.part_weight(i, dtype, None) for i in range(len(self.parts))])

    def dequantize(self, packed: PackedLinearKernels, dtype: torch.dtype) -> torch.Tensor:
        weights = [self.part_weight(i, dtype, packed) for i in range(len(self.parts))]
        return weights[0] if len(weights) == 1 else torch.cat(weights)  # a dense run, uncopied

    def stream_rows(self, packed: PackedLinearKernels, dtype: torch.dtype) -> int:
        rows = kernel_max_rows(packed, dtype)
        return LANES_KERNEL_MAX_ROWS if rows == TILED_KERNEL_MAX_ROWS and self.model_in_lanes else rows

    def in_lanes(self) -> bool:
        """Whether every run of this layer was repacked into lanes."""
        return all(part.code in LANES.values() for part in self.parts)

    def stream(self, packed: PackedLinearKernels, flat: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
        out = flat.new_empty(flat.shape[0], self.out_features, dtype=out_dtype)
        for part, weight in zip(self.parts, self.weights):
            bias = None if self.bias is None else self.bias[part.rows]
            if part.kind is None:
                out[:, part.rows] = self.ops.linear(flat, weight, bias)
            else:
                packed.gguf_linear(flat, weight, part.code, bias, out[:, part.rows])
        return out


class GgufEmbedding(EmbeddingRows, GgufLinear):
    """A token embedding as the GGUF file stores it."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # One checkpoint tensor (token_embd) fills the table, so it is one part.
        (part,), (weight,) = self.parts, self.weights
        chosen = weight.index_select(0, input_ids.flatten())
        packed = self.ops.packed
        if part.kind is None:
            rows = chosen
        elif packed is None:
            rows = part.dequantize(chosen, self.in_features)
        else:
            rows = packed.gguf_dequantize(chosen, part.code, self.in_features, self.dtype)
        return rows.to(self.dtype).view(*input_ids.shape, self.in_features)


def output_logits(projection: nn.Module, hidden: torch.Tensor,
                  dense_logits: Callable[..., torch.Tensor] = TORCH_OPS.logits) -> torch.Tensor:
    """The fp32 logits hidden @ W.T of an output projection: an lm_head (bias-free) or the
    token embedding it is tied to. Each value is rounded to hidden's dtype first (the result
    widened exactly); the int8 kernel and `dense_logits` (the model's bound kernels, where
    it has them) write fp32 themselves."""
    if isinstance(projection, EmbeddingRows):
        return projection.project(hidden, torch.float32)
    if isinstance(projection, QuantizedLinear):
        return projection(hidden, torch.float32)
    prepacked = getattr(projection, "prepacked", None)  # layers.Prepacks' tiles
    return dense_logits(hidden, projection.weight if prepacked is None else prepacked)


def quantize_model(model: nn.Module, quantization: str, group_size: int) -> None:
    """Swap every linear (merged ones included) and every token embedding for an empty
    quantized twin; the weights are loaded afterwards. Embeddings and output projections
    (lm_head) are int8 in both modes, as the default GGUF itself ships its embedding as
    Q8_0: they are read once per token and their rows carry the logits. "gguf": every
    layer keeps the blocks its GGUF file stores (GgufLinear, GgufEmbedding). A MoE layer's
    experts are linears of every expert's rows (moe.ExpertsLinear), quantized alike."""
    if quantization == "none":
        return
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            output_sizes = getattr(module, "output_sizes", [module.out_features])
            bias = module.bias is not None
            if quantization == "gguf":
                twin = GgufLinear(module.in_features, output_sizes, bias)
            elif quantization == "int4" and not name.endswith("lm_head"):
                if module.in_features % group_size:
                    raise ValueError(
                        f"quantization_group_size={group_size} must divide the input size "
                        f"of every layer, but {name} has {module.in_features}; use one of "
                        f"{[g for g in QUANTIZATION_GROUP_SIZES if module.in_features % g == 0]}")
                twin = Int4Linear(module.in_features, output_sizes, bias, group_size)
            else:
                twin = Int8Linear(module.in_features, output_sizes, bias)
        elif isinstance(module, nn.Embedding) and name.endswith("embed_tokens"):
            twin = (GgufEmbedding if quantization == "gguf" else Int8Embedding)(
                module.num_embeddings, module.embedding_dim)
        else:
            continue
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, twin)


def weight_bytes_by_type(model: nn.Module) -> dict[str, int]:
    """The model's weight bytes per storage type: GGUF layers' parts under their GGUF type
    names (Q4_K, Q6_K, ...), every other parameter under its dtype's name."""
    totals: dict[str, int] = {}
    counted: set[int] = set()
    for module in model.modules():
        if isinstance(module, GgufLinear):
            for name, size in module.weight_bytes_by_type().items():
                totals[name] = totals.get(name, 0) + size
            counted.update(id(weight) for weight in module.weights)
    for parameter in model.parameters():
        if id(parameter) not in counted:
            name = str(parameter.dtype).removeprefix("torch.")
            totals[name] = totals.get(name, 0) + parameter.numel() * parameter.element_size()
    return totals


def repack_gguf(model: nn.Module, packed: PackedLinearKernels, dtype: torch.dtype) -> None:
    """Every GGUF layer's runs that the bound kernels stream faster in a form of their own
    (packed.gguf_repacked_type) repacked into it, for activations in `dtype`."""
    layers = [layer for layer in model.modules() if isinstance(layer, GgufLinear)]
    for layer in layers:
        layer.repack(lambda kind: packed.gguf_repacked_type(kind, dtype))
    in_lanes = all(layer.in_lanes() for layer in layers)
    for layer in layers:
        layer.model_in_lanes = in_lanes


def pack_model(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Convert every staged quantized layer into its kernel layout on `device`."""
    for layer in [module for module in model.modules() if isinstance(module, QuantizedLinear)]:
        layer.pack(dtype, device)
