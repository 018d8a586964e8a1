"""Weight-only quantization: int4 (grouped, scale and zero per group) and int8 (per output
channel) linears and embeddings that keep activations in the model's dtype.

A model is built dense, `quantize_model` swaps its linears and token embedding for empty
quantized twins, the weights are loaded into those (dense tensors are quantized as they
arrive; GGUF blocks of the same format are copied exactly), and `pack_model` converts them
into the layout of PyTorch's packed CPU matmuls. Elsewhere (CUDA, or shapes those kernels
refuse) the packed weights are de-quantized on every forward, with a warning.
"""

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import QUANTIZATION_GROUP_SIZES

logger = logging.getLogger(__name__)
INT4_MID = 8  # the int4 kernels compute (q - 8) * scale + zero
CPU_INT4_ROWS_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu needs N % 16 == 0


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


def dense(tensor: "torch.Tensor | GroupQuantized") -> torch.Tensor:
    """A checkpoint tensor as a plain tensor, whatever form it arrived in."""
    return tensor.dequantize() if isinstance(tensor, GroupQuantized) else tensor


def quantize_int4(weight: torch.Tensor, group_size: int) -> GroupQuantized:
    """Asymmetric min/max int4 per group (llama.cpp's Q4_1 rule): q in 0..15."""
    rows, cols = weight.shape
    grouped = weight.float().view(rows, -1, group_size)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = ((grouped - low.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15)
    return GroupQuantized(q.to(torch.uint8).view(rows, cols), scale, low, group_size, 4)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (q int8 [rows, cols], scale fp32 [rows])."""
    weight = weight.float()
    scale = (weight.abs().amax(-1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = (weight / scale.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def frozen(tensor: torch.Tensor) -> nn.Parameter:
    """Packed weights are parameters (so weight_bytes and .to() see them) that never train."""
    return nn.Parameter(tensor, requires_grad=False)


class QuantizedLinear(nn.Module):
    """Base of the quantized twins of nn.Linear / MergedLinear: same in/out sizes, same
    `load_part` and `split`, weights staged in fp32-scaled integers until `pack`."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = output_sizes
        self.out_features = sum(output_sizes)
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None
        self.use_kernel = False

    def load_part(self, param_name: str, index: int, tensor) -> None:
        start = sum(self.output_sizes[:index])
        rows = slice(start, start + self.output_sizes[index])
        if param_name == "bias":
            self.bias.data[rows].copy_(dense(tensor))
        else:
            self.stage_rows(rows, tensor)

    def split(self, output: torch.Tensor) -> list[torch.Tensor]:
        return list(output.split(self.output_sizes, dim=-1))

    def add_bias(self, output: torch.Tensor) -> torch.Tensor:
        return output if self.bias is None else output + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int4Linear(QuantizedLinear):
    """y = x @ ((q - 8) * scale + zero).T with q int4 packed two to a byte, one scale and
    zero per `group_size` inputs of each output row."""

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
        # Blocks of the same shape (GGUF Q4_0 / Q4_1 at group 32) copy exactly; anything
        # else is re-quantized from its de-quantized values.
        blocks = tensor if matches else quantize_int4(dense(tensor), self.group_size)
        self.staged_q[rows] = blocks.q
        self.staged_scale[rows] = blocks.scale
        self.staged_offset[rows] = blocks.offset

    def pack(self, dtype: torch.dtype, device: torch.device) -> None:
        q, scale, offset = self.staged_q, self.staged_scale, self.staged_offset
        del self.staged_q, self.staged_scale, self.staged_offset
        # q * scale + offset == (q - 8) * scale + zero with zero = offset + 8 * scale
        zero = offset + INT4_MID * scale
        self.use_kernel = (device.type == "cpu"
                           and self.out_features % CPU_INT4_ROWS_MULTIPLE == 0)
        if self.use_kernel:
            self.weight = frozen(torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                q.to(torch.int32), 2).to(device))
            # [groups, out, 2]: the scale and zero of one group sit next to each other.
            self.scales_and_zeros = frozen(
                torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(device, dtype))
        else:
            warn_fallback(self, device)
            self.weight = frozen((q[:, 0::2] | (q[:, 1::2] << 4)).to(device))
            self.scales_and_zeros = frozen(torch.stack([scale, zero], dim=-1).to(device, dtype))

    def dequantized_weight(self) -> torch.Tensor:
        """The fallback's weight: unpacked nibbles as a dense matrix of the activation dtype."""
        packed = self.weight
        q = torch.stack([packed & 15, packed >> 4], dim=-1).view(self.out_features, -1)
        grouped = q.view(self.out_features, -1, self.group_size).to(self.scales_and_zeros.dtype)
        scale, zero = self.scales_and_zeros.unbind(-1)
        return ((grouped - INT4_MID) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        if self.use_kernel:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, self.weight, self.group_size, self.scales_and_zeros)
        else:
            out = F.linear(flat, self.dequantized_weight())
        return self.add_bias(out.view(*x.shape[:-1], self.out_features))


class Int8Linear(QuantizedLinear):
    """y = x @ (q * scale).T with q int8 and one scale per output row."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, output_sizes, bias)
        self.staged_q = torch.zeros(self.out_features, in_features, dtype=torch.int8,
                                    device="cpu")
        self.staged_scale = torch.zeros(self.out_features, dtype=torch.float32, device="cpu")

    def stage_rows(self, rows: slice, tensor) -> None:
        # Per-row scales fit no GGUF block format, so every source is re-quantized.
        self.staged_q[rows], self.staged_scale[rows] = quantize_int8(dense(tensor))

    def pack(self, dtype: torch.dtype, device: torch.device) -> None:
        self.use_kernel = device.type == "cpu"
        if not self.use_kernel:
            warn_fallback(self, device)
        self.weight = frozen(self.staged_q.to(device))
        self.scales = frozen(self.staged_scale.to(device, dtype))
        del self.staged_q, self.staged_scale

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.to(self.scales.dtype) * self.scales.unsqueeze(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        if self.use_kernel:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales)
        else:
            out = F.linear(flat, self.dequantized_weight())
        return self.add_bias(out.view(*x.shape[:-1], self.out_features))


class Int8Embedding(Int8Linear):
    """A token embedding as int8 rows with one scale each. Looking a token up de-quantizes
    its row; `project` uses the same rows as a tied output projection (the logits)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(embedding_dim, [num_embeddings], bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.index_select(0, input_ids.flatten()).to(self.scales.dtype)
        rows = rows * self.scales.index_select(0, input_ids.flatten()).unsqueeze(-1)
        return rows.view(*input_ids.shape, self.in_features)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden)


def tied_logits(embedding: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """hidden @ embedding.T for an output projection tied to the token embedding."""
    if isinstance(embedding, Int8Embedding):
        return embedding.project(hidden)
    return F.linear(hidden, embedding.weight)


def warn_fallback(layer: QuantizedLinear, device: torch.device) -> None:
    logger.warning("no packed %s matmul for a %dx%d layer on %s: de-quantizing its weight "
                   "on every forward (correct, but slower than dense)", type(layer).__name__,
                   layer.out_features, layer.in_features, device)


def quantize_model(model: nn.Module, quantization: str, group_size: int) -> None:
    """Swap every linear (merged ones included) and every token embedding for an empty
    quantized twin; the weights are loaded afterwards. Embeddings and output projections
    (lm_head) are int8 in both modes, as the default GGUF itself ships its embedding as
    Q8_0: they are read once per token and their rows carry the logits."""
    if quantization == "none":
        return
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            output_sizes = getattr(module, "output_sizes", [module.out_features])
            bias = module.bias is not None
            if quantization == "int4" and not name.endswith("lm_head"):
                if module.in_features % group_size:
                    raise ValueError(
                        f"quantization_group_size={group_size} must divide the input size "
                        f"of every layer, but {name} has {module.in_features}; use one of "
                        f"{[g for g in QUANTIZATION_GROUP_SIZES if module.in_features % g == 0]}")
                twin = Int4Linear(module.in_features, output_sizes, bias, group_size)
            else:
                twin = Int8Linear(module.in_features, output_sizes, bias)
        elif isinstance(module, nn.Embedding) and name.endswith("embed_tokens"):
            twin = Int8Embedding(module.num_embeddings, module.embedding_dim)
        else:
            continue
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, twin)


def pack_model(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Convert every staged quantized layer into its kernel layout on `device`."""
    layers = [module for module in model.modules() if isinstance(module, QuantizedLinear)]
    for layer in layers:
        layer.pack(dtype, device)
    if layers and device.type == "cpu" and dtype == torch.float32:
        logger.warning("the packed int4/int8 CPU matmuls run one to two orders of magnitude "
                       "slower than dense layers with float32 activations: use "
                       "dtype='bfloat16' (or 'auto' on a CPU with native bf16)")
