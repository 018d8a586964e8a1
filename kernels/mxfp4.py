"""MXFP4 weights as gpt-oss ships its experts (`quantization_config.quant_method: mxfp4`), in
plain torch: the de-quantization (the torch path, and the oracle of the C++ kernels), and a
quantizer that writes the format (tests and benches make checkpoints with it).

A weight [out, in] is kept as `blocks` uint8 [out, in / 32, 16] and `scales` uint8
[out, in / 32]: each group of 32 inputs is 16 bytes of 4-bit e2m1 codes, input 2j in byte j's
low nibble and input 2j + 1 in its high one, and one e8m0 scale byte s, the group's values
being FP4_VALUES[code] * 2 ** (s - 127). (A checkpoint's `*_blocks` / `*_scales` tensors hold
every expert's, [experts, out, in / 32, 16] and [experts, out, in / 32]; transformers'
integrations/mxfp4.py reads them so.)
"""

import torch

GROUP = 32  # inputs per scale
GROUP_BYTES = GROUP // 2
SCALE_BIAS = 127
# e2m1's 16 codes: sign bit 3, then 2 exponent bits and 1 mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def check(blocks: torch.Tensor, scales: torch.Tensor, in_features: int, name: str) -> None:
    """ValueError naming `name` unless blocks and scales are one [.., out, in] weight's."""
    groups = in_features // GROUP
    if in_features % GROUP:
        raise ValueError(f"{name}: in_features={in_features} must be a multiple of {GROUP} "
                         "(MXFP4 scales 32 inputs each)")
    if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8
            or blocks.shape[-2:] != (groups, GROUP_BYTES)
            or scales.shape != blocks.shape[:-1]):
        raise ValueError(
            f"{name}: MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales "
            f"{tuple(scales.shape)} {scales.dtype} must be uint8 [..., out, {groups}, "
            f"{GROUP_BYTES}] and [..., out, {groups}] for {in_features} inputs")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight [..., out, in] in `dtype` (exact: every MXFP4 value is a float32 and
    bfloat16 value while 2 ** (s - 127) is)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., groups, 16, 2]
    values = lut[codes].flatten(-2)  # [..., groups, 32]: input 2j, then 2j + 1
    exponents = scales.to(torch.int32) - SCALE_BIAS
    factors = torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents)
    return (values * factors.unsqueeze(-1)).flatten(-2).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of weight [..., out, in]: each group's scale the least power of two
    that brings its largest magnitude within e2m1's 6, each value rounded to the nearest
    code."""
    groups = weight.float().unflatten(-1, (-1, GROUP))
    largest = groups.abs().amax(-1).clamp(min=2.0 ** -126)
    exponent = torch.ceil(torch.log2(largest / 6)).clamp(-SCALE_BIAS, 254 - SCALE_BIAS)
    scaled = groups / torch.ldexp(torch.ones_like(exponent), exponent.int()).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + SCALE_BIAS).to(torch.uint8)
