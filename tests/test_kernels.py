"""Paged attention and KV store: Triton kernels, the C++ CPU kernels and the torch twins
against dense attention.

Without CUDA the Triton kernels run on CPU tensors in the Triton interpreter (kept small
so the file stays quick); with CUDA they run natively on CUDA tensors (bench/gpu_check.py).
The C++ kernels are built once per CPU and source and cached (kernels/cpu_extension.py).
"""

import itertools
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # @triton.jit reads this when the kernel modules are first imported, so it must be set
    # before that; it changes nothing for the torch path other tests use.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvscope import kernels
from kvscope.kernels import cpu_extension, cpu_kernels, kv_quant, reference
from kvscope.kernels.kernel_ops import AttentionCall

try:
    from kvscope.kernels.triton_attention import INTERPRETED
    from kvscope.kernels.triton_attention import attend as triton_attend
    from kvscope.kernels.triton_attention import paged_attention as triton_paged_attention
    from kvscope.kernels.triton_kv_store import store_kv as triton_store_kv
except ImportError:  # triton is not installed: only the torch twins are tested
    triton_store_kv = triton_paged_attention = triton_attend = None
    INTERPRETED = False

REPO_ROOT = Path(__file__).resolve().parent.parent

if torch.cuda.is_available():
    TRITON_DEVICES = ["cuda"] if triton_paged_attention is not None else []
    REFERENCE_DEVICES = ["cpu", "cuda"]
else:
    TRITON_DEVICES = ["cpu"] if triton_paged_attention is not None and INTERPRETED else []
    REFERENCE_DEVICES = ["cpu"]

needs_triton = pytest.mark.skipif(
    not TRITON_DEVICES, reason="triton is not installed (or TRITON_INTERPRET=0 without CUDA)")

TOLERANCE = {  # (atol, rtol) against float64 dense attention
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


@dataclass(slots=True)
class PagedBatch:
    """A ragged batch in the paged layout plus the same K/V per sequence, unpaged."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: list[torch.Tensor]  # per sequence [seq_len, kv_heads, head_dim]
    values: list[torch.Tensor]
    scale: float
    sliding_window: int | None = None

    def args(self, finite: bool = False) -> tuple:
        """Arguments for paged_attention; finite=True zeroes the never-written slots."""
        key_cache, value_cache = self.key_cache, self.value_cache
        if finite:
            key_cache, value_cache = key_cache.nan_to_num(0.0), value_cache.nan_to_num(0.0)
        return (self.query, key_cache, value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)


def make_batch(
    seqs: list[tuple[int, int]],
    block_size: int,
    num_kv_heads: int,
    queries_per_kv: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    sliding_window: int | None = None,
) -> PagedBatch:
    """seqs: (seq_len, query_len) per sequence. Physical blocks are shuffled over a pool
    twice the size needed; every slot no sequence owns, including the tail of each last
    block and the blocks that pad the block tables, holds NaN, so reading one shows.
    With a sliding window, the table entries of blocks wholly before every new token's
    window are -1, as the KV manager leaves them when it frees those blocks."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for seq_len, _ in seqs]
    num_blocks = 2 * sum(blocks_per_seq) + 1
    physical = torch.randperm(num_blocks, generator=generator)
    unused_block = int(physical[-1])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.full((len(seqs), max(blocks_per_seq) + 1), unused_block,
                              dtype=torch.int32)
    keys, values = [], []
    next_block = 0
    for i, (seq_len, _) in enumerate(seqs):
        table = physical[next_block:next_block + blocks_per_seq[i]]
        next_block += blocks_per_seq[i]
        block_tables[i, :len(table)] = table
        key = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        value = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        positions = torch.arange(seq_len)
        slots = table[positions // block_size] * block_size + positions % block_size
        key_cache.view(-1, num_kv_heads, head_dim)[slots] = key
        value_cache.view(-1, num_kv_heads, head_dim)[slots] = value
        if sliding_window:
            first_visible = max(0, seq_len - seqs[i][1] - sliding_window + 1)
            block_tables[i, :first_visible // block_size] = -1
        keys.append(key)
        values.append(value)
    query_lens = torch.tensor([query_len for _, query_len in seqs])
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = query_lens.cumsum(0)
    num_tokens = int(query_start_loc[-1])
    query = torch.randn(num_tokens, num_kv_heads * queries_per_kv, head_dim,
                        generator=generator).to(dtype)
    return PagedBatch(
        query=query.to(device), key_cache=key_cache.to(device),
        value_cache=value_cache.to(device), block_tables=block_tables.to(device),
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device), keys=keys, values=values,
        scale=head_dim ** -0.5, sliding_window=sliding_window,
    )


def dense_attention(batch: PagedBatch, soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention from the unpaged K/V, in float64 on the CPU (within the batch's
    sliding window, soft-capped if asked, with each head's sink logit in its softmax's
    denominator if given: transformers' gpt-oss attention)."""
    query = batch.query.cpu().double()
    out = torch.zeros_like(query)
    starts = batch.query_start_loc.tolist()
    queries_per_kv = query.shape[1] // batch.keys[0].shape[1]
    for i, (key, value) in enumerate(zip(batch.keys, batch.values, strict=True)):
        start, end = starts[i], starts[i + 1]
        seq_len, query_len = key.shape[0], end - start
        key = key.double().repeat_interleave(queries_per_kv, dim=1)
        value = value.double().repeat_interleave(queries_per_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[start:end], key) * batch.scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        query_pos = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
        key_pos = torch.arange(seq_len).unsqueeze(0)
        hidden = key_pos > query_pos
        if batch.sliding_window:
            hidden |= key_pos <= query_pos - batch.sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is None:
            weights = scores.softmax(-1)
        else:
            sink_column = sinks.cpu().double().view(-1, 1, 1).expand(*scores.shape[:2], 1)
            weights = torch.cat([scores, sink_column], -1).softmax(-1)[..., :-1]
        out[start:end] = torch.einsum("hqk,khd->qhd", weights, value)
    return out


def make_sinks(num_heads: int, device: str = "cpu") -> torch.Tensor:
    """fp32 sink logits around the scores' range: some heads' sinks take most of the weight,
    others almost none."""
    generator = torch.Generator().manual_seed(7)
    return (torch.randn(num_heads, generator=generator) * 3).to(device)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                 factor: float = 1.0) -> None:
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.cpu().double(), expected.cpu().double(),
                               atol=atol * factor, rtol=rtol * factor)


def mixed_seqs(block_size: int) -> list[tuple[int, int]]:
    """(seq_len, query_len): a cold prefill, a prefill over cached context, a chunk in the
    middle of a prompt, and decodes at a block boundary and one either side of it."""
    decodes = sorted({max(1, block_size - 1), block_size, block_size + 1, 2 * block_size + 1})
    return [
        (19, 19),  # cold prefill
        (40, 13),  # prefill whose first 27 tokens hit the prefix cache
        (33, 6),  # a chunk of a longer prompt: 27 tokens done, 6 now, more to come
        *[(seq_len, 1) for seq_len in decodes],
    ]


def boundary_seqs(block_size: int) -> list[tuple[int, int]]:
    """Prefills and decodes whose lengths sit at block boundaries and one either side."""
    lengths = sorted({max(1, block_size - 1), block_size, block_size + 1})
    return ([(n, n) for n in lengths] + [(n + block_size, block_size) for n in lengths]
            + [(n, 1) for n in lengths])


# --- the torch twins against dense attention (not interpreted: fast) ---------------------


@pytest.mark.parametrize("device", REFERENCE_DEVICES)
@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 128])
@pytest.mark.parametrize(("queries_per_kv", "head_dim"), [(1, 64), (3, 80), (4, 128)])
def test_reference_attention_matches_dense(device, block_size, queries_per_kv, head_dim):
    for seqs in (mixed_seqs(block_size), boundary_seqs(block_size)):
        batch = make_batch(seqs, block_size, 2, queries_per_kv, head_dim, device=device)
        out = reference.paged_attention(*batch.args(finite=True))
        assert_close(out, dense_attention(batch), torch.float32)


@pytest.mark.parametrize("device", REFERENCE_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_attention_low_precision_matches_dense(device, dtype):
    batch = make_batch(mixed_seqs(16), 16, 2, 3, 80, dtype=dtype, device=device)
    out = reference.paged_attention(*batch.args(finite=True))
    assert out.dtype == dtype
    assert_close(out, dense_attention(batch), dtype)


def test_reference_attention_writes_into_out():
    batch = make_batch(mixed_seqs(8), 8, 1, 2, 64)
    out = torch.empty_like(batch.query)
    result = reference.paged_attention(*batch.args(finite=True), out=out)
    assert result.data_ptr() == out.data_ptr()
    assert_close(out, dense_attention(batch), torch.float32)


# --- the C++ CPU kernels -------------------------------------------------------------------


CPU_CASES = [  # (block_size, queries_per_kv, head_dim): every block size, GQA ratio, dim
    pytest.param(1, 1, 64, id="block1-mha-d64"),
    pytest.param(4, 3, 128, id="block4-gqa3-d128"),
    pytest.param(16, 3, 64, id="block16-gqa3-d64"),
    pytest.param(32, 4, 128, id="block32-gqa4-d128"),
    pytest.param(128, 8, 64, id="block128-gqa8-d64"),
    pytest.param(256, 8, 128, id="block256-gqa8-d128"),
    pytest.param(16, 4, 256, id="block16-gqa4-d256"),  # Gemma 3's heads
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "queries_per_kv", "head_dim"), CPU_CASES)
def test_cpu_attention_matches_dense(cpu_kernel_ops, block_size, queries_per_kv, head_dim, dtype):
    for seqs in (mixed_seqs(block_size), boundary_seqs(block_size)):
        batch = make_batch(seqs, block_size, 2, queries_per_kv, head_dim, dtype=dtype)
        out = cpu_kernel_ops.paged_attention(*batch.args())  # unused slots hold NaN: never read
        assert out.dtype == dtype and out.shape == batch.query.shape
        assert_close(out, dense_attention(batch), dtype)


@pytest.mark.parametrize("seqs", [
    pytest.param([(1, 1)], id="one-token-prompt"),
    pytest.param([(1, 1), (2, 1), (1, 1)], id="one-token-decodes"),
    pytest.param([(1200, 1)], id="one-long-decode-split-over-threads"),
    pytest.param([(700, 1), (3, 1), (40, 40)], id="long-decode-beside-a-prefill"),
    pytest.param([(90, 37)], id="prefill-longer-than-a-query-tile"),
])
def test_cpu_attention_edge_cases(cpu_kernel_ops, seqs):
    batch = make_batch(seqs, 16, 3, 3, 64)
    assert_close(cpu_kernel_ops.paged_attention(*batch.args()), dense_attention(batch), torch.float32)


@pytest.mark.parametrize(("seqs", "head_dim", "window"), [
    pytest.param([(300, 5)], 64, None, id="verify-4-over-300-keys"),
    pytest.param([(1203, 5)], 128, None, id="verify-4-over-1200-keys"),
    pytest.param([(190, 17), (40, 17)], 64, None, id="two-verify-16"),
    pytest.param([(700, 5)], 64, 200, id="verify-4-in-a-window"),
])
def test_cpu_attention_verification_rows_equal_their_decodes(cpu_kernel_ops, seqs, head_dim,
                                                             window):
    """Each query token of a short chunk (a speculative verification) computes bit for bit
    what a decode of that token computes, so greedy output cannot drift with speculation."""
    batch = make_batch(seqs, 16, 3, 3, head_dim, dtype=torch.bfloat16, sliding_window=window)
    chunk = cpu_kernel_ops.paged_attention(*batch.args(), sliding_window=window)
    query_len = seqs[0][1]
    starts = batch.query_start_loc[:-1].long()
    for t in range(query_len):
        decodes = cpu_kernel_ops.paged_attention(
            batch.query[starts + t], batch.key_cache, batch.value_cache, batch.block_tables,
            batch.seq_lens - query_len + t + 1, torch.arange(len(seqs) + 1, dtype=torch.int32),
            batch.scale, sliding_window=window)
        assert torch.equal(chunk[starts + t], decodes), f"query token {t}"


@pytest.mark.parametrize(("queries_per_kv", "head_dim", "window", "soft_cap"), [
    pytest.param(1, 64, None, None, id="mha-d64"),
    pytest.param(3, 64, None, None, id="gqa3-d64"),
    pytest.param(2, 128, None, None, id="gqa2-d128"),
    pytest.param(8, 128, 200, None, id="gqa8-d128-window200"),
    pytest.param(3, 64, None, 30.0, id="gqa3-d64-softcap30"),
    pytest.param(4, 256, 512, None, id="gqa4-d256-window512"),
])
def test_cpu_attention_long_bf16_prefills_match_dense(cpu_kernel_ops, queries_per_kv, head_dim,
                                                      window, soft_cap):
    """Prefill chunks longer than a verification run as tiles of bf16 pair-dot products
    (scores, then weights rounded to bf16 times values): cold, over cached context, odd
    lengths over several key chunks, beside decodes. Against float64 dense attention the
    error stays that of bf16 rounding, and the row path (an fp32 query over the same bf16
    cache) agrees within a few bf16 steps."""
    seqs = [(600, 600), (700, 300), (333, 45), (260, 1), (129, 129)]
    batch = make_batch(seqs, 16, 2, queries_per_kv, head_dim, dtype=torch.bfloat16,
                       sliding_window=window)
    out = cpu_kernel_ops.paged_attention(*batch.args(), sliding_window=window, soft_cap=soft_cap)
    expected = dense_attention(batch, soft_cap)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)
    rows = cpu_kernel_ops.paged_attention(batch.query.float(), *batch.args()[1:],
                                          sliding_window=window, soft_cap=soft_cap)
    torch.testing.assert_close(out.double(), rows.double(), atol=1e-2, rtol=1e-2)


def prepacked_weight(ops, weight):
    """The weight prepacked in tiles (kvscope's own, or oneDNN's AMX tiles), or None where
    this CPU's kernels take no tiles (no AVX512-BF16)."""
    return None if ops.prepack_weight is None else ops.prepack_weight(weight)


def test_cpu_row_ops_compute_each_row_as_alone(cpu_kernel_ops):
    """The linears (5 rows here: a decode or a verification of 4 proposals), logits,
    rms_norm, rotary and silu_and_mul give each row bit for bit what it gets alone in bf16,
    so a verification chunk's rows are its tokens' decodes."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 192, generator=generator).bfloat16()
    weight = torch.randn(320, 192, generator=generator).bfloat16()
    bias = torch.randn(320, generator=generator).bfloat16()
    residual = torch.randn(5, 192, generator=generator).bfloat16()
    cos, sin = torch.randn(2, 5, 64, generator=generator).unbind(0)
    ops = cpu_kernel_ops

    def rotated(rows, c, s):
        rows = rows.clone()
        ops.rotary_embedding(rows, c, s, 3, 64)
        return rows

    row_ops = {
        "linear": lambda r: ops.linear(x[r], weight, bias),
        "logits": lambda r: ops.logits(x[r], weight),
        "rms_norm": lambda r: ops.rms_norm(x[r], weight[0], 1e-5, residual[r].clone()),
        "rotary": lambda r: rotated(x[r], cos[r], sin[r]),
        "silu_and_mul": lambda r: ops.silu_and_mul(x[r]),
    }
    prepacked = prepacked_weight(ops, weight)
    if prepacked is not None:
        row_ops["prepacked linear"] = lambda r: ops.linear(x[r], prepacked, bias)
        row_ops["prepacked logits"] = lambda r: ops.logits(x[r], prepacked)
    for name, op in row_ops.items():
        chunk = op(slice(0, 5))
        for row in range(5):
            assert torch.equal(chunk[row:row + 1], op(slice(row, row + 1))), (name, row)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("in_features", [200, 576])
def test_cpu_streaming_linear_widens_each_weight_once_for_every_row(cpu_kernel_ops, dtype,
                                                                   in_features):
    """The streaming linear multiplies each widened weight chunk into a group of rows at
    once; a row's result is still the one it gets alone, bit for bit, in any group and any
    batch size (also past the last whole chunk of 32 inputs: 200, and past the rows the
    engine streams), and the float64 oracle's within a rounding."""
    generator = torch.Generator().manual_seed(in_features)
    weight = torch.randn(97, in_features, generator=generator).to(dtype)  # an odd last output
    bias = torch.randn(97, generator=generator).to(dtype)
    for rows in [*range(1, 10), 16, 17, cpu_kernels.DENSE_KERNEL_MAX_ROWS, 41]:
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        out = torch.empty(rows, 97, dtype=dtype)
        torch.ops.kvscope.linear_small_batch(x, weight, bias, out)
        for row in range(rows):
            alone = torch.empty(1, 97, dtype=dtype)
            torch.ops.kvscope.linear_small_batch(x[row:row + 1], weight, bias, alone)
            assert torch.equal(out[row:row + 1], alone), (rows, row)
        expected = F.linear(x.double(), weight.double(), bias.double())
        tolerance = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out.double(), expected.to(dtype).double(), rtol=tolerance,
                                   atol=tolerance)


@pytest.mark.parametrize("rows", [1, 3, 5, 6, 40, 70, 130])
def test_cpu_prepacked_linear_matches_the_plain_weight(cpu_kernel_ops, rows):
    """A weight kept only in tiles: its blocks read back as the weight
    (reference.blocked_to_plain), and the blocked kernel (any rows over kvscope's tiles, up
    to AMX_TILE_KERNEL_MAX_ROWS over oneDNN's) and oneDNN's GEMM (more rows over its AMX
    tiles) give x @ W.T + b to bf16 rounding, from a strided x too."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(320, 128, generator=generator).bfloat16()
    bias = torch.randn(320, generator=generator).bfloat16()
    x = torch.randn(rows, 256, generator=generator).bfloat16()[:, 64:192]
    prepacked = prepacked_weight(cpu_kernel_ops, weight)
    if prepacked is None:
        pytest.skip("prepack_weights: this CPU's C++ kernels read no tiles (they need "
                    "AVX512-BF16)")
    assert prepacked.blocks.numel() == weight.numel()
    assert torch.equal(reference.blocked_to_plain(prepacked.blocks, 320, 128), weight)
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    for out_dtype in (None, torch.float32):
        out = cpu_kernel_ops.linear(x, prepacked, bias, out_dtype=out_dtype)
        assert out.dtype == (out_dtype or torch.bfloat16) and out.shape == (rows, 320)
        torch.testing.assert_close(out.double(), expected, atol=0.1, rtol=1e-2)
    assert cpu_kernel_ops.prepack_weight(weight[:, :100].contiguous()) is None  # 100 inputs: no tiles
    assert cpu_kernel_ops.prepack_weight(weight.float()) is None


@pytest.mark.parametrize("tile", [32, 64])
@pytest.mark.parametrize(("rows", "in_features", "out_features"),
                         [(1, 96, 5 * 64), (2, 96, 5 * 64), (5, 96, 5 * 64), (17, 96, 5 * 64),
                          (33, 96, 5 * 64), (64, 96, 5 * 64), (131, 96, 5 * 64),
                          (1, 800, 21 * 64), (40, 800, 21 * 64), (64, 800, 21 * 64)])
def test_cpu_blocked_linear_reads_both_tile_widths(cpu_kernel_ops, tile, rows, in_features,
                                                   out_features):
    """The blocked kernel reads tiles of 32 outputs (oneDNN's, with AMX: on AMX itself, in
    blocks of 16 rows, two at a time) and of 64 (kvscope's own), blocks [out / T, T * in]
    (reference.plain_to_blocked, blocked_to_plain's inverse): an odd number of tile columns,
    bias, and each row equal to what it gets alone, past a partial row block (17, 33, 40),
    past the rows from which the threads share out rows instead of columns (131), over
    longer rows and more columns (800 inputs, 21 or 42 columns), and the same at any thread
    count (the threads share out the columns, or 131 rows, unevenly)."""
    if not torch.ops.kvscope.has_blocked_linear():
        pytest.skip("the blocked kernel needs AVX512-BF16")
    generator = torch.Generator().manual_seed(6)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16()
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    blocks = reference.plain_to_blocked(weight, tile)
    assert blocks.shape == (out_features // tile, tile * in_features)
    assert torch.equal(reference.blocked_to_plain(blocks, out_features, in_features), weight)
    out = torch.empty(rows, out_features, dtype=torch.bfloat16)
    torch.ops.kvscope.linear_blocked(x, blocks, bias, out)
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(out.double(), expected, atol=0.1, rtol=1e-2)
    for row in range(rows):
        alone = torch.empty(1, out_features, dtype=torch.bfloat16)
        torch.ops.kvscope.linear_blocked(x[row:row + 1], blocks, bias, alone)
        assert torch.equal(out[row:row + 1], alone), row
    threads = torch.get_num_threads()
    try:
        for num_threads in (2, 3):
            torch.set_num_threads(num_threads)
            shared = torch.empty_like(out)
            torch.ops.kvscope.linear_blocked(x, blocks, bias, shared)
            assert torch.equal(shared, out), num_threads
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("rows", "in_features", "out_features"),
                         [(6, 64, 100), (40, 576, 1536), (7, 100, 33), (50, 8192, 600)])
def test_cpu_widened_linear_matches_its_oracle(cpu_kernel_ops, rows, in_features, out_features):
    """bf16 GEMMs as fp32 GEMMs over widened weight tiles (CPUs without bf16 dot products):
    the fp32 product rounded to bf16 once, from a strided x, with and without bias, over
    more than one tile and a partial last one (8,192 inputs: tiles of 256 rows); the fp32 out
    is that bf16 value widened."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(rows, 2 * in_features, generator=generator).bfloat16()[:, in_features // 2:][
        :, :in_features]
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16()
    for b in (None, bias):
        for out_dtype in (torch.bfloat16, torch.float32):
            out = torch.empty(rows, out_features, dtype=out_dtype)
            torch.ops.kvscope.linear_widened(x, weight, b, out)
            expected = reference.widened_linear(x, weight, b, out_dtype).float()
            # The fp32 sums' order is the GEMM's: a last bf16 bit, or where a sum nearly
            # cancels, fp32 rounding of its terms' magnitude (which then moves the small
            # result by more than its last bit). A wrong tile would miss by whole terms.
            magnitude = x.float().abs() @ weight.float().abs().T
            allowed = expected.abs() * 2 ** -7 + magnitude * 2 ** -20
            assert ((out.float() - expected).abs() <= allowed).all(), (b is None, out_dtype)
    assert cpu_kernel_ops.linear(x, weight, bias).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="linear_widened: bf16 x, weight and bias"):
        torch.ops.kvscope.linear_widened(x.float(), weight, None, torch.empty(rows, out_features))


def test_cpu_linear_widens_bf16_gemms_only_without_bf16_dot_products(cpu_kernel_ops):
    """Where the CPU has no AVX512-BF16 or AMX, the cpu backend's linear of WIDENED_MIN_ROWS
    rows or more is the widened GEMM's result, bit for bit; of fewer rows (past the
    streaming kernel's), and on other CPUs, oneDNN's bf16 GEMM."""
    generator = torch.Generator().manual_seed(12)
    weight = torch.randn(256, 128, generator=generator).bfloat16()
    for rows in (cpu_kernels.WIDENED_MIN_ROWS - 1, cpu_kernels.WIDENED_MIN_ROWS):
        x = torch.randn(rows, 128, generator=generator).bfloat16()
        widened = torch.empty(rows, 256, dtype=torch.bfloat16)
        torch.ops.kvscope.linear_widened(x, weight, None, widened)
        widens = cpu_kernels.widens_bf16_gemms() and rows >= cpu_kernels.WIDENED_MIN_ROWS
        assert torch.equal(cpu_kernel_ops.linear(x, weight),
                           widened if widens else F.linear(x, weight)), rows
    flags = cpu_extension.build_flags()
    assert cpu_kernels.widens_bf16_gemms() == (
        "avx512_bf16" not in flags and "amx_bf16" not in flags)


def test_cpu_attention_empty_batch_and_strided_query(cpu_kernel_ops):
    batch = make_batch([(5, 1)], 8, 1, 2, 64)
    empty = torch.empty(0, 2, 64)
    no_seqs = torch.empty(0, dtype=torch.int32)
    out = cpu_kernel_ops.paged_attention(empty, batch.key_cache, batch.value_cache,
                                  batch.block_tables[:0], no_seqs,
                                  torch.zeros(1, dtype=torch.int32), batch.scale)
    assert out.shape == (0, 2, 64)
    fused = torch.cat([batch.query, torch.full_like(batch.query, float("nan"))], dim=1)
    strided = fused[:, :2]  # a view into fused projections, as a model's split gives
    args = batch.args()
    out = cpu_kernel_ops.paged_attention(strided, *args[1:])
    assert_close(out, dense_attention(batch), torch.float32)


def test_cpu_attention_fp32_query_over_bf16_cache(cpu_kernel_ops):
    batch = make_batch(mixed_seqs(16), 16, 2, 4, 64, dtype=torch.bfloat16)
    query = batch.query.float()
    out = cpu_kernel_ops.paged_attention(query, *batch.args()[1:])
    assert out.dtype == torch.float32
    assert_close(out, dense_attention(batch), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_cpu_store_kv_matches_reference(cpu_kernel_ops, dtype, block_size):
    key, value, key_cache, value_cache, slots = _store_case("cpu", dtype, dtype,
                                                            block_size=block_size)
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    reference.store_kv(key, value, expected_keys, expected_values, slots)
    cpu_kernel_ops.store_kv(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_keys)
    assert torch.equal(value_cache, expected_values)


# --- quantized KV caches (kv_cache_dtype fp8 / fp8_e5m2 / int8) ----------------------------

KV_CODE_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
QUANTIZED_CASES = [  # (block_size, queries_per_kv, head_dim): both compiled dims, a runtime one
    pytest.param(1, 1, 64, id="block1-mha-d64"),
    pytest.param(16, 3, 80, id="block16-gqa3-d80"),
    pytest.param(32, 4, 128, id="block32-gqa4-d128"),
]


def quantized_caches(batch: PagedBatch, codes: torch.dtype, store_kv) -> tuple:
    """The batch's K/V written by `store_kv` into zeroed caches of `codes` (the layout
    of kernels/kv_quant.py), and those caches de-quantized to fp32 for the oracle."""
    num_blocks, block_size, kv_heads, head_dim = batch.key_cache.shape
    shape = (num_blocks, block_size, kv_heads, kv_quant.row_width(head_dim, codes))
    key_cache = torch.zeros(shape, dtype=codes, device=batch.query.device)
    value_cache = torch.zeros_like(key_cache)
    for i, (key, value) in enumerate(zip(batch.keys, batch.values, strict=True)):
        positions = torch.arange(key.shape[0])
        table = batch.block_tables[i].cpu().long()
        slots = table[positions // block_size] * block_size + positions % block_size
        store_kv(key.to(batch.query.device), value.to(batch.query.device), key_cache,
                 value_cache, slots.to(batch.query.device))
    return key_cache, value_cache, (kv_quant.dequantize(key_cache, torch.float32),
                                    kv_quant.dequantize(value_cache, torch.float32))


def oracle_on_dequantized(batch: PagedBatch, dequantized: tuple) -> torch.Tensor:
    return reference.paged_attention(batch.query.float(), *dequantized, *batch.args()[3:])


@pytest.mark.parametrize("codes", KV_CODE_DTYPES)
@pytest.mark.parametrize(("block_size", "queries_per_kv", "head_dim"), QUANTIZED_CASES)
def test_reference_reads_quantized_caches_as_de_quantized(codes, block_size, queries_per_kv,
                                                          head_dim):
    batch = make_batch(mixed_seqs(block_size), block_size, 2, queries_per_kv, head_dim)
    key_cache, value_cache, dequantized = quantized_caches(batch, codes, reference.store_kv)
    out = reference.paged_attention(batch.query, key_cache, value_cache, *batch.args()[3:])
    assert_close(out, oracle_on_dequantized(batch, dequantized), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("codes", KV_CODE_DTYPES)
@pytest.mark.parametrize(("block_size", "queries_per_kv", "head_dim"), QUANTIZED_CASES)
def test_cpu_kernels_store_and_read_quantized_caches(cpu_kernel_ops, dtype, codes, block_size,
                                                     queries_per_kv, head_dim):
    """store_kv's codes and scales are the oracle's bit for bit; attention over them is the
    oracle's over the de-quantized caches (ragged: prefills, chunks, decodes, one split)."""
    seqs = mixed_seqs(block_size) + [(700, 1)]
    batch = make_batch(seqs, block_size, 2, queries_per_kv, head_dim, dtype=dtype)
    key_cache, value_cache, _ = quantized_caches(batch, codes, cpu_kernel_ops.store_kv)
    expected_keys, expected_values, dequantized = quantized_caches(batch, codes,
                                                                   reference.store_kv)
    assert torch.equal(key_cache.view(torch.uint8), expected_keys.view(torch.uint8))
    assert torch.equal(value_cache.view(torch.uint8), expected_values.view(torch.uint8))
    out = cpu_kernel_ops.paged_attention(batch.query, key_cache, value_cache, *batch.args()[3:])
    assert out.dtype == dtype
    assert_close(out, oracle_on_dequantized(batch, dequantized), dtype)


@pytest.mark.parametrize("codes", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize(("queries_per_kv", "head_dim"), [
    pytest.param(3, 64, id="gqa3-d64"),
    pytest.param(2, 128, id="gqa2-d128"),
    pytest.param(4, 256, id="gqa4-d256"),
])
def test_cpu_long_bf16_prefills_over_quantized_caches_match_the_oracle(cpu_kernel_ops, codes,
                                                                       queries_per_kv, head_dim):
    """Long prefill chunks over a quantized cache run as tiles of matrix products too: the
    codes converted to bf16 (exactly), each key's scale on its score and each value's on its
    weight. Cold, over cached context, odd lengths over several key chunks, beside decodes,
    against the oracle over the de-quantized caches, within bf16 rounding of the weights."""
    seqs = [(600, 600), (700, 300), (333, 45), (260, 1), (129, 129)]
    batch = make_batch(seqs, 16, 2, queries_per_kv, head_dim, dtype=torch.bfloat16)
    key_cache, value_cache, dequantized = quantized_caches(batch, codes, cpu_kernel_ops.store_kv)
    out = cpu_kernel_ops.paged_attention(batch.query, key_cache, value_cache, *batch.args()[3:])
    expected = oracle_on_dequantized(batch, dequantized)
    torch.testing.assert_close(out.double(), expected.double(), atol=1e-2, rtol=1e-2)


def test_cpu_store_kv_refuses_rows_that_do_not_fit_a_quantized_cache(cpu_kernel_ops):
    cache = torch.zeros(2, 4, 1, 64, dtype=torch.int8)  # no room for the scale
    rows = torch.randn(1, 1, 64)
    with pytest.raises(RuntimeError, match="codes and a scale"):
        cpu_kernel_ops.store_kv(rows, rows, cache, cache.clone(), torch.tensor([0]))


def test_cpu_greedy_tokens_are_argmax_and_its_log_softmax(cpu_kernel_ops):
    """Each row's first largest logit (ties included, and in the rows' last partial vector)
    and that token's log_softmax, as torch computes them."""
    logits = torch.randn(5, 49157, generator=torch.Generator().manual_seed(0)) * 4
    logits[1, 40000] = logits[1, 100] = logits[1].max() + 1  # a tie: the first one wins
    logits[2] = 0.0
    logits[3, -1] = 50.0  # beyond the last whole vector of 16
    logits[4, :1000] = float("-inf")
    expected = torch.log_softmax(logits.double(), dim=-1)
    threads = torch.get_num_threads()
    try:
        # Fewer rows than threads split each row in pieces (3 threads: uneven ones).
        for num_threads, (first, last) in itertools.product((1, 3), ((0, 5), (1, 2), (3, 5))):
            torch.set_num_threads(num_threads)
            tokens, logprobs = cpu_kernel_ops.greedy_tokens(logits[first:last].contiguous())
            assert tokens == logits[first:last].argmax(dim=-1).tolist()
            chosen = expected[first:last].gather(1, torch.tensor(tokens)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.double), chosen,
                                       rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_the_sampler_picks_greedy_rows_alike_with_and_without_the_cpu_op(cpu_kernel_ops):
    """With unedited logits an all-greedy batch goes through the kernels' greedy_tokens (the
    C++ one, or the torch twin by default); logits given apart from the raw ones take the
    log_softmax path: all pick the same."""
    from kvscope import SamplingParams
    from kvscope.engine.sample.sampler import sample

    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(1)) * 3
    params = [SamplingParams(temperature=0)] * 3
    one_pass = sample(logits, params, [None] * 3, greedy_tokens=cpu_kernel_ops.greedy_tokens)
    general = sample(logits, params, [None] * 3, raw_logits=logits.clone())
    twin = sample(logits, params, [None] * 3)  # the torch backend's greedy_tokens
    assert one_pass.token_ids == general.token_ids == twin.token_ids
    assert twin.logprobs == general.logprobs
    torch.testing.assert_close(torch.tensor(one_pass.logprobs), torch.tensor(general.logprobs))


def test_cpu_build_key_names_the_cpu_and_torch(monkeypatch):
    from kvscope.kernels import cpu_extension

    key = cpu_extension.build_key()
    monkeypatch.setattr(cpu_extension, "cpu_flags", lambda: "fpu sse avx2")
    assert cpu_extension.build_key() != key  # an AVX2-only CPU gets a build of its own
    monkeypatch.setattr(cpu_extension.torch, "__version__", "0.0.0")
    assert cpu_extension.build_key() != key


def test_cpu_kernels_load_past_a_build_lock_left_by_a_killed_build(cpu_kernel_ops):
    """torch's build lock is a file: one left by a build killed midway (Ctrl-C on the first
    start) made every later start wait forever. A start now removes it and loads."""
    from kvscope.kernels import cpu_extension

    build_dir = cpu_extension.cache_dir() / "cpu_kernels" / cpu_extension.build_key()
    (build_dir / "lock").touch()
    loaded = subprocess.run(
        [sys.executable, "-c", "from kvscope.kernels import cpu_kernels; cpu_kernels.load()"],
        cwd=Path(__file__).resolve().parents[1], timeout=120, capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    assert not (build_dir / "lock").exists()


def test_a_build_reports_its_progress_while_it_compiles(tmp_path, monkeypatch, caplog):
    """A first build takes minutes with no output of its own: every PROGRESS_EVERY_S it
    says how many sources are compiled (an object file each), and stops with the build."""
    from kvscope.kernels import cpu_extension

    monkeypatch.setattr(cpu_extension, "PROGRESS_EVERY_S", 0.02)
    caplog.set_level(logging.INFO, logger=cpu_extension.__name__)
    with cpu_extension.progress_reports(tmp_path):
        (tmp_path / "a.o").touch()
        (tmp_path / "b.o").touch()
        time.sleep(0.2)
    reports = [record.getMessage() for record in caplog.records]
    assert reports and reports[-1].endswith(f"2 of {len(cpu_extension.sources())} sources compiled")
    time.sleep(0.1)
    assert len(caplog.records) == len(reports)


# --- the Triton paged-attention kernel ----------------------------------------------------

ATTENTION_CASES = [  # (block_size, queries_per_kv, head_dim, dtype): every value of each
    pytest.param(1, 1, 64, torch.float32, id="block1-mha-d64-fp32"),
    pytest.param(8, 3, 80, torch.float32, id="block8-gqa3-d80-fp32"),
    pytest.param(16, 4, 128, torch.float32, id="block16-gqa4-d128-fp32"),
    pytest.param(32, 3, 64, torch.bfloat16, id="block32-gqa3-d64-bf16"),
    pytest.param(128, 4, 80, torch.float16, id="block128-gqa4-d80-fp16"),
]


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(("block_size", "queries_per_kv", "head_dim", "dtype"), ATTENTION_CASES)
def test_triton_attention_mixed_batch(device, block_size, queries_per_kv, head_dim, dtype):
    batch = make_batch(mixed_seqs(block_size), block_size, 2, queries_per_kv, head_dim,
                       dtype=dtype, device=device)
    out = triton_paged_attention(*batch.args())
    assert out.dtype == dtype and out.shape == batch.query.shape
    assert_close(out, dense_attention(batch), dtype)
    twin = reference.paged_attention(*batch.args(finite=True))
    assert_close(out, twin, dtype, factor=2.0)


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_triton_attention_at_block_boundaries(device, block_size):
    batch = make_batch(boundary_seqs(block_size), block_size, 1, 2, 64, device=device)
    out = triton_paged_attention(*batch.args())
    assert_close(out, dense_attention(batch), torch.float32)


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(("block_m", "block_n", "block_size"), [
    (16, 16, 128),  # several key tiles per cache block
    (16, 128, 8),  # several cache blocks per key tile
    (32, 32, 32),
])
def test_triton_attention_tile_size_is_independent_of_block_size(
        device, block_m, block_n, block_size):
    batch = make_batch(mixed_seqs(block_size), block_size, 1, 4, 64, device=device)
    out = triton_attend(AttentionCall(*batch.args()), block_m=block_m, block_n=block_n)
    assert_close(out, dense_attention(batch), torch.float32)


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(("seqs", "num_kv_splits"), [
    pytest.param([(70, 1), (5, 1), (130, 1)], 3, id="decodes-3-splits"),
    pytest.param([(1, 1), (64, 1)], 8, id="decodes-more-splits-than-tiles"),
    pytest.param([(40, 13), (30, 30), (66, 1)], 2, id="mixed-2-splits"),
])
def test_triton_attention_split_kv_matches_dense(device, seqs, num_kv_splits):
    batch = make_batch(seqs, 16, 2, 2, 64, device=device)
    out = triton_attend(AttentionCall(*batch.args()), block_n=16, num_kv_splits=num_kv_splits)
    assert_close(out, dense_attention(batch), torch.float32)


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_attention_decode_only_batch_with_default_tiles(device):
    """A decode step as the engine runs it (on a GPU the heuristics split long sequences)."""
    batch = make_batch([(600, 1), (17, 1), (64, 1)], 16, 2, 4, 64, device=device)
    metadata = [batch.block_tables.long(), batch.seq_lens.long(), batch.query_start_loc.long()]
    out = triton_paged_attention(batch.query, batch.key_cache, batch.value_cache, *metadata,
                                 batch.scale)
    assert_close(out, dense_attention(batch), torch.float32)


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(("head_dim", "block_size"), [(32, 256), (96, 4), (256, 2)])
def test_triton_attention_other_head_and_block_sizes(device, head_dim, block_size):
    seqs = [(block_size + 3, 4), (2, 1), (37, 1)]
    batch = make_batch(seqs, block_size, 1, 2, head_dim, device=device)
    out = triton_paged_attention(*batch.args())
    assert_close(out, dense_attention(batch), torch.float32)


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_attention_writes_into_strided_out(device):
    batch = make_batch([(20, 20), (9, 1)], 8, 1, 2, 64, device=device)
    fused = torch.full((batch.query.shape[0], 3, 2, 64), float("nan"), device=device)
    out = fused[:, 1]  # a view with strides of a larger buffer
    result = triton_paged_attention(*batch.args(), out=out)
    assert result.data_ptr() == out.data_ptr()
    assert_close(out, dense_attention(batch), torch.float32)
    assert fused[:, 0].isnan().all() and fused[:, 2].isnan().all()


# --- the KV store -------------------------------------------------------------------------


def _store_case(device, dtype, cache_dtype, block_size=8, num_kv_heads=3, head_dim=80):
    generator = torch.Generator().manual_seed(1)
    num_tokens = 17
    num_blocks = -(-2 * num_tokens // block_size)
    # Fused QKV-like rows: key and value are strided views, as a model's projections give.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=generator).to(dtype)
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads:2 * num_kv_heads]
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[[3, 11]] = -1  # padding tokens
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    value_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    return [t.to(device) for t in (key, value, key_cache, value_cache, slots)]


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(("dtype", "cache_dtype"), [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16), (torch.float32, torch.bfloat16),
])
@pytest.mark.parametrize("block_size", [1, 16])
def test_triton_store_kv_matches_reference(device, dtype, cache_dtype, block_size):
    key, value, key_cache, value_cache, slots = _store_case(device, dtype, cache_dtype,
                                                            block_size=block_size)
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    reference.store_kv(key, value, expected_keys, expected_values, slots)
    triton_store_kv(key, value, key_cache, value_cache, slots.to(torch.int32))
    if dtype == cache_dtype:
        assert torch.equal(key_cache, expected_keys)
        assert torch.equal(value_cache, expected_values)
    else:  # a cast may round the last bit either way (the interpreter truncates)
        torch.testing.assert_close(key_cache, expected_keys, atol=0, rtol=2 ** -7)
        torch.testing.assert_close(value_cache, expected_values, atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("device", REFERENCE_DEVICES)
def test_reference_store_kv_writes_slots_and_skips_padding(device):
    key, value, key_cache, value_cache, slots = _store_case(device, torch.float32,
                                                            torch.float32)
    assert slots.shape[0] == key.shape[0]
    before = key_cache.clone()
    reference.store_kv(key, value, key_cache, value_cache, slots)
    flat_keys, flat_values = key_cache.view(-1, 3, 80), value_cache.view(-1, 3, 80)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_keys[slot], key[token])
            assert torch.equal(flat_values[slot], value[token])
    untouched = torch.ones(flat_keys.shape[0], dtype=torch.bool, device=device)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(flat_keys[untouched], before.view(-1, 3, 80)[untouched])


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_store_then_attend_with_triton_matches_dense(device):
    """The two kernels together, as a model layer uses them: store a step's K/V, attend."""
    batch = make_batch([(24, 8), (10, 1)], 8, 2, 2, 64, device=device)
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    slots = []
    for i, (key, _) in enumerate(zip(batch.keys, batch.values, strict=True)):
        query_len = int(batch.query_start_loc[i + 1] - batch.query_start_loc[i])
        for position in range(key.shape[0] - query_len, key.shape[0]):
            block = int(batch.block_tables[i, position // 8])
            slots.append(block * 8 + position % 8)
    slots = torch.tensor(slots, device=device)
    flat = key_cache.view(-1, 2, 64)
    flat[slots] = float("nan")  # the new tokens' slots hold garbage until stored
    value_cache.view(-1, 2, 64)[slots] = float("nan")
    new_keys = torch.cat([k[-n:] for k, n in zip(batch.keys, [8, 1], strict=True)]).to(device)
    new_values = torch.cat([v[-n:] for v, n in zip(batch.values, [8, 1], strict=True)]).to(device)
    triton_store_kv(new_keys, new_values, key_cache, value_cache, slots)
    out = triton_paged_attention(batch.query, key_cache, value_cache, batch.block_tables,
                                 batch.seq_lens, batch.query_start_loc, batch.scale)
    assert_close(out, dense_attention(batch), torch.float32)


# --- the Triton kernels over quantized KV caches (kv_cache_dtype fp8 / fp8_e5m2 / int8) -----


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("codes", KV_CODE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_store_kv_quantizes_as_the_oracle(device, codes, dtype):
    """Codes and scales bit for bit, for rows from 1e-6 to 1e3 (fp8's subnormal codes
    included), zero and -0.0 rows, padding slots and strided rows."""
    key, value, _, _, slots = _store_case(device, dtype, dtype, block_size=4)
    scales = torch.logspace(-6, 3, key.shape[0], device=device)[:, None, None]
    key.mul_(scales.to(dtype))  # in place: the rows stay strided views of fused QKV rows
    value.mul_(scales.flip(0).to(dtype))
    key[0, 0], key[1, 1] = 0.0, -0.0
    num_tokens, num_kv_heads, head_dim = key.shape
    shape = (-(-2 * num_tokens // 4), 4, num_kv_heads, kv_quant.row_width(head_dim, codes))
    key_cache = torch.zeros(shape, dtype=codes, device=device)
    value_cache = torch.zeros_like(key_cache)
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    reference.store_kv(key, value, expected_keys, expected_values, slots)
    triton_store_kv(key, value, key_cache, value_cache, slots.to(torch.int32))
    assert torch.equal(key_cache.view(torch.uint8), expected_keys.view(torch.uint8))
    assert torch.equal(value_cache.view(torch.uint8), expected_values.view(torch.uint8))


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("codes", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_triton_store_kv_rounds_to_the_nearest_float8_code_ties_to_even(device, codes):
    """Every finite code's value and every midpoint between neighbours (a row led by the
    largest code, so its scale is 1): each is stored as torch's cast rounds it."""
    every_code = torch.arange(256, dtype=torch.uint8).view(codes).float()
    grid = every_code[every_code.isfinite()].unique()  # sorted, -0.0 merged into 0.0
    values = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, -grid[1:] / 3])
    head_dim = 63
    rows = torch.nn.functional.pad(values, (0, -values.shape[0] % head_dim))
    rows = torch.cat([torch.full((rows.shape[0] // head_dim, 1), kv_quant.CODE_MAX[codes]),
                      rows.view(-1, head_dim)], dim=1).unsqueeze(1).to(device)
    cache = torch.zeros(rows.shape[0], 1, 1, head_dim + 1 + kv_quant.SCALE_ELEMENTS,
                        dtype=codes, device=device)
    slots = torch.arange(rows.shape[0], device=device)
    triton_store_kv(rows, rows, cache, torch.zeros_like(cache), slots.to(torch.int32))
    assert bool((kv_quant.scales(cache) == 1.0).all())
    expected = rows.to(codes).view(torch.uint8)
    assert torch.equal(cache.view(torch.uint8)[:, 0, :, :-kv_quant.SCALE_ELEMENTS], expected)


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("codes", KV_CODE_DTYPES)
@pytest.mark.parametrize(("block_size", "queries_per_kv", "head_dim"), QUANTIZED_CASES)
def test_triton_attention_reads_quantized_caches_as_de_quantized(device, codes, block_size,
                                                                 queries_per_kv, head_dim):
    """Attention over caches the Triton store quantized (the oracle's bytes) is the oracle's
    over the de-quantized caches: prefills, a cached prefix, a chunk, decodes at block
    boundaries, GQA."""
    batch = make_batch(mixed_seqs(block_size), block_size, 2, queries_per_kv, head_dim,
                       device=device)
    key_cache, value_cache, _ = quantized_caches(batch, codes, triton_store_kv)
    expected_keys, expected_values, dequantized = quantized_caches(batch, codes,
                                                                   reference.store_kv)
    assert torch.equal(key_cache.view(torch.uint8), expected_keys.view(torch.uint8))
    assert torch.equal(value_cache.view(torch.uint8), expected_values.view(torch.uint8))
    out = triton_paged_attention(batch.query, key_cache, value_cache, *batch.args()[3:])
    assert_close(out, oracle_on_dequantized(batch, dequantized), torch.float32)


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("codes", KV_CODE_DTYPES)
def test_triton_attention_reads_quantized_caches_for_half_queries(device, dtype, codes):
    """bf16 / fp16 queries, decodes whose keys split over programs: de-quantized rows are
    rounded to the query's dtype, as the oracle's are (fp8_e5m2's scales, amax / 57344,
    would underflow fp16 if they were applied to the softmax weights instead)."""
    batch = make_batch([(70, 1), (5, 1), (130, 1), (21, 4)], 16, 2, 3, 80, dtype=dtype,
                       device=device)
    key_cache, value_cache, dequantized = quantized_caches(batch, codes, triton_store_kv)
    out = triton_attend(AttentionCall(batch.query, key_cache, value_cache, *batch.args()[3:]),
                        block_n=16, num_kv_splits=3)
    assert out.dtype == dtype
    assert_close(out, oracle_on_dequantized(batch, dequantized), dtype)


@needs_triton
def test_triton_store_kv_refuses_rows_that_do_not_fit_a_quantized_cache():
    cache = torch.zeros(2, 4, 1, 64, dtype=torch.int8)  # no room for the scale
    rows = torch.randn(1, 1, 64)
    with pytest.raises(ValueError, match="codes and a scale"):
        triton_store_kv(rows, rows, cache, cache.clone(), torch.tensor([0]))


# --- dispatch -----------------------------------------------------------------------------


def test_cpu_tensors_use_the_cpu_kernels_by_default(monkeypatch):
    monkeypatch.delenv(kernels.BACKEND_ENV, raising=False)
    ops = kernels.select_ops("cpu")
    assert ops.backend == "cpu"
    batch = make_batch(mixed_seqs(8), 8, 1, 2, 64)
    out = ops.paged_attention(*batch.args())  # NaN-filled slots: the twin would give NaN
    assert_close(out, dense_attention(batch), torch.float32)


def test_only_the_cpu_backend_module_reaches_the_extension():
    """Every caller gets its kernels from the KernelOps the model runner chose: nothing
    else names (or probes) torch.ops.kvscope or torch.classes.kvscope."""
    root = Path(__file__).resolve().parents[1]
    sources = [path for folder in ("kvscope", "engine", "kernels", "ui")
               for path in (root / folder).rglob("*.py")]
    use = re.compile(r"torch\.(ops|classes)\.kvscope\.|[hg]etattr\(torch\.(ops|classes)"
                     r"|hasattr\(torch\.(ops|classes)")
    reaching = [str(path.relative_to(root)) for path in sources if use.search(path.read_text())]
    assert reaching == ["kernels/cpu_kernels.py"]


def test_the_kernels_import_nothing_above_them():
    """The kernels are the lowest stage: the engine, the dashboard and the session log
    import them, never the reverse."""
    root = Path(__file__).resolve().parents[1]
    upward = re.compile(r"\bkvscope\.(engine|ui|storage|app)\b")
    importing = [str(path.relative_to(root)) for path in (root / "kernels").rglob("*.py")
                 if upward.search(path.read_text())]
    assert importing == []


def test_the_torch_backend_lacks_the_cpu_only_kernels(monkeypatch):
    """Packed-weight kernels and the decoder stack are None where the C++ kernels do not run
    (quantized layers then take their torch twin, the model its layers one by one)."""
    monkeypatch.setenv(kernels.BACKEND_ENV, "torch")
    assert kernels.select_ops("cpu") is kernels.TORCH_OPS
    assert kernels.TORCH_OPS.packed is None and kernels.TORCH_OPS.decoder_stack is None
    monkeypatch.delenv(kernels.BACKEND_ENV)
    cpu = kernels.select_ops("cpu")
    assert cpu.packed is not None and cpu.decoder_stack is not None


def test_backend_env_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(kernels.BACKEND_ENV, "cutlass")
    with pytest.raises(ValueError, match=kernels.BACKEND_ENV):
        kernels.backend_name("cpu")


def test_backend_env_forces_torch(monkeypatch):
    monkeypatch.setenv(kernels.BACKEND_ENV, "torch")
    assert kernels.backend_name("cuda") == "torch"
    ops = kernels.select_ops("cpu")
    assert ops.paged_attention is reference.paged_attention
    assert ops.store_kv is reference.store_kv


def test_backend_env_cpu_refuses_cuda(monkeypatch):
    monkeypatch.setenv(kernels.BACKEND_ENV, "cpu")
    assert kernels.backend_name("cpu") == "cpu"
    with pytest.raises(ValueError, match="CPU tensors only"):
        kernels.backend_name("cuda")


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreted CPU path")
def test_backend_env_forces_interpreted_triton_on_cpu(monkeypatch):
    monkeypatch.setenv(kernels.BACKEND_ENV, "triton")
    ops = kernels.select_ops("cpu")
    assert ops.backend == "triton"
    batch = make_batch(mixed_seqs(8), 8, 1, 2, 64)
    out = ops.paged_attention(*batch.args())
    assert_close(out, dense_attention(batch), torch.float32)
    key, value, key_cache, value_cache, slots = _store_case("cpu", torch.float32, torch.float32)
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    reference.store_kv(key, value, expected_keys, expected_values, slots)
    ops.store_kv(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_keys) and torch.equal(value_cache, expected_values)


_SUBPROCESS_CHECKS = r"""
import os, sys
import torch

# 1. Triton forced on CPU tensors without the interpreter: a clear error.
os.environ.pop("TRITON_INTERPRET", None)
os.environ["KVSCOPE_ATTENTION_BACKEND"] = "triton"
from kvscope import kernels
try:
    kernels.backend_name("cpu")
except ValueError as error:
    assert "TRITON_INTERPRET" in str(error), error
else:
    raise AssertionError("forcing triton on CPU without the interpreter did not raise")
"""

_NO_TRITON_CHECKS = r"""
import os, sys
sys.modules["triton"] = None  # as if triton were not installed
import torch
from kvscope import kernels
assert kernels.backend_name("cuda") == "torch"
assert not kernels.triton_available()
os.environ["KVSCOPE_ATTENTION_BACKEND"] = "torch"
query = torch.randn(3, 2, 32)
cache = torch.randn(4, 2, 1, 32)
out = kernels.select_ops("cpu").paged_attention(query, cache, cache, torch.tensor([[0, 1], [2, 3]],
    dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32),
    torch.tensor([0, 2, 3], dtype=torch.int32), 0.2)
assert out.shape == query.shape and not out.isnan().any()
os.environ["KVSCOPE_ATTENTION_BACKEND"] = "triton"
try:
    kernels.backend_name("cpu")
except ValueError as error:
    assert "not installed" in str(error), error
else:
    raise AssertionError("forcing triton without triton installed did not raise")
"""


@pytest.mark.parametrize("script", [
    pytest.param(_SUBPROCESS_CHECKS, id="triton-on-cpu-needs-interpreter",
                 marks=needs_triton),
    pytest.param(_NO_TRITON_CHECKS, id="works-without-triton"),
])
def test_dispatch_in_a_fresh_process(script):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", script], check=False, env=env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# --- sliding windows and soft-capping, every backend against dense attention ----------------


def windowed_seqs(window: int) -> list[tuple[int, int]]:
    """(seq_len, query_len): prompts shorter than, equal to and longer than the window,
    chunks over context already past it, a prefill longer than a query tile, and decodes
    either side of it."""
    return [(window - 3, window - 3), (window, window), (3 * window + 5, 3 * window + 5),
            (2 * window + 7, 9), (90, 37), (window - 1, 1), (window + 1, 1),
            (5 * window + 3, 1)]


WINDOW_CASES = [  # (block_size, window, soft_cap)
    pytest.param(4, 8, None, id="block4-window8"),
    pytest.param(16, 20, None, id="block16-window20"),
    pytest.param(16, None, 30.0, id="block16-softcap30"),
    pytest.param(8, 13, 5.0, id="block8-window13-softcap5"),
]


def windowed_batch(block_size, window, dtype=torch.float32, device="cpu", **kwargs):
    return make_batch(windowed_seqs(window or 16), block_size, 2, 3, 64, dtype=dtype,
                      device=device, sliding_window=window, **kwargs)


@pytest.mark.parametrize(("block_size", "window", "soft_cap"), WINDOW_CASES)
def test_reference_attention_window_and_soft_cap_match_dense(block_size, window, soft_cap):
    batch = windowed_batch(block_size, window)
    out = reference.paged_attention(*batch.args(finite=True), sliding_window=window,
                                    soft_cap=soft_cap)
    assert_close(out, dense_attention(batch, soft_cap), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "window", "soft_cap"), WINDOW_CASES)
def test_cpu_attention_window_and_soft_cap_match_dense(cpu_kernel_ops, block_size, window,
                                                       soft_cap, dtype):
    batch = windowed_batch(block_size, window, dtype=dtype)
    # freed blocks (-1) before each window: never read
    out = cpu_kernel_ops.paged_attention(*batch.args(), sliding_window=window, soft_cap=soft_cap)
    assert_close(out, dense_attention(batch, soft_cap), dtype)


def test_cpu_attention_window_on_a_long_decode_split_over_threads(cpu_kernel_ops):
    batch = make_batch([(1500, 1), (700, 1)], 16, 2, 4, 128, sliding_window=400)
    out = cpu_kernel_ops.paged_attention(*batch.args(), sliding_window=400)
    assert_close(out, dense_attention(batch), torch.float32)


def test_cpu_attention_refuses_a_negative_window(cpu_kernel_ops):
    batch = windowed_batch(4, 8)
    with pytest.raises(RuntimeError, match="window and soft_cap"):
        cpu_kernel_ops.paged_attention(*batch.args(), sliding_window=-1)


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(("block_size", "window", "soft_cap"), WINDOW_CASES)
def test_triton_attention_window_and_soft_cap_match_dense(device, block_size, window, soft_cap):
    batch = windowed_batch(block_size, window, device=device)
    out = triton_paged_attention(*batch.args(), sliding_window=window, soft_cap=soft_cap)
    assert_close(out, dense_attention(batch, soft_cap), torch.float32)


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_attention_window_with_split_kv(device):
    batch = make_batch([(200, 1), (77, 1), (9, 1)], 8, 2, 2, 64, device=device,
                       sliding_window=50)
    out = triton_attend(AttentionCall(*batch.args(), sliding_window=50), block_n=16,
                        num_kv_splits=3)
    assert_close(out, dense_attention(batch), torch.float32)


# --- block-table entries out of range: refused by name, never read as an address ----------


def _attention_backend(name: str, request):
    if name == "cpu":
        return request.getfixturevalue("cpu_kernel_ops").paged_attention
    if name == "triton":
        if not TRITON_DEVICES:
            pytest.skip("triton is not installed (or TRITON_INTERPRET=0 without CUDA)")
        return triton_paged_attention
    return reference.paged_attention


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize(("window", "entry", "value"), [
    # The first entry the window reads, freed (-1) as a manager releasing one block too
    # early leaves it; the one before it may be -1 and is not read.
    pytest.param(8, 4, -1, id="window-released-too-early"),
    pytest.param(None, 2, -1, id="full-negative"),
    pytest.param(None, 5, "num_blocks", id="full-past-the-pool"),
])
def test_attention_refuses_a_block_table_entry_out_of_range(backend, window, entry, value,
                                                            request):
    """A decode at position 24 with window 8 over blocks of 4 sees keys 17..24: entries
    4..6. Each backend names the sequence and the entry (a ValueError) before reading."""
    paged_attention = _attention_backend(backend, request)
    batch = make_batch([(9, 9), (25, 1), (6, 1)], 4, 2, 2, 64,
                       device=TRITON_DEVICES[0] if backend == "triton" else "cpu",
                       sliding_window=window)
    num_blocks = batch.key_cache.shape[0]
    tables = batch.block_tables
    if window:
        assert tables[1, :entry].tolist() == [-1] * entry and tables[1, entry] >= 0
    tables[1, entry] = num_blocks if value == "num_blocks" else value
    bad = int(tables[1, entry])
    with pytest.raises(ValueError, match=(
            rf"block_tables\[1\]\[{entry}\] = {bad}, outside the cache's blocks "
            rf"\[0, {num_blocks}\), but sequence 1 reads it")):
        paged_attention(*batch.args(finite=True), sliding_window=window)
    # The same table with the entry back in range is read as before.
    tables[1, entry] = 0
    paged_attention(*batch.args(finite=True), sliding_window=window)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_attention_refuses_a_block_table_row_too_short_for_its_keys(backend, request):
    paged_attention = _attention_backend(backend, request)
    batch = make_batch([(9, 1), (25, 1)], 4, 2, 2, 64,
                       device=TRITON_DEVICES[0] if backend == "triton" else "cpu")
    short = batch.block_tables[:, :5].contiguous()
    with pytest.raises(ValueError, match=r"sequence 1 .*7 entries.* its row has 5"):
        paged_attention(batch.query, batch.key_cache, batch.value_cache, short,
                        batch.seq_lens, batch.query_start_loc, batch.scale)


# --- attention sinks (gpt-oss), every backend against dense attention -----------------------

SINK_CASES = [  # (block_size, window): gpt-oss alternates windowed and full layers
    pytest.param(16, None, id="block16-full"),
    pytest.param(8, 13, id="block8-window13"),
]


def sink_batch(block_size, window, dtype=torch.float32, device="cpu"):
    """Prefills (cold, over context, chunks) and decodes, 6 query heads over 2 KV heads."""
    return windowed_batch(block_size, window, dtype=dtype, device=device)


@pytest.mark.parametrize(("block_size", "window"), SINK_CASES)
def test_reference_attention_with_sinks_matches_dense(block_size, window):
    batch = sink_batch(block_size, window)
    sinks = make_sinks(6)
    out = reference.paged_attention(*batch.args(finite=True), sliding_window=window, sinks=sinks)
    assert_close(out, dense_attention(batch, sinks=sinks), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "window"), SINK_CASES)
def test_cpu_attention_with_sinks_matches_dense(cpu_kernel_ops, block_size, window, dtype):
    batch = sink_batch(block_size, window, dtype=dtype)
    sinks = make_sinks(6)
    out = cpu_kernel_ops.paged_attention(*batch.args(), sliding_window=window, sinks=sinks)
    assert_close(out, dense_attention(batch, sinks=sinks), dtype)


@pytest.mark.parametrize(("seqs", "window"), [
    pytest.param([(1500, 1)], None, id="decode-split"),
    pytest.param([(1500, 1)], 400, id="windowed-decode-split"),
    pytest.param([(300, 5)], None, id="verification-chunk-split"),
    pytest.param([(1500, 1), (700, 1)], None, id="two-decodes"),
])
def test_cpu_attention_with_sinks_merges_key_splits(cpu_kernel_ops, seqs, window):
    """A decode's keys split over threads (a lone sequence splits even on one thread): the
    sink joins the merged denominator once."""
    batch = make_batch(seqs, 16, 2, 4, 128, sliding_window=window)
    sinks = make_sinks(8)
    out = cpu_kernel_ops.paged_attention(*batch.args(), sliding_window=window, sinks=sinks)
    assert_close(out, dense_attention(batch, sinks=sinks), torch.float32)


@pytest.mark.parametrize(("queries_per_kv", "head_dim", "window"), [
    pytest.param(8, 64, None, id="gqa8-d64"),  # gpt-oss's heads: 64 query, 8 KV, head_dim 64
    pytest.param(4, 128, 200, id="gqa4-d128-window200"),
])
def test_cpu_long_bf16_prefills_with_sinks_match_dense(cpu_kernel_ops, queries_per_kv, head_dim,
                                                       window):
    """Prefill chunks on the tiles of pair-dot products (prefill_tiles.h) normalise with the
    sink too."""
    seqs = [(600, 600), (700, 300), (333, 45), (260, 1)]
    batch = make_batch(seqs, 16, 2, queries_per_kv, head_dim, dtype=torch.bfloat16,
                       sliding_window=window)
    sinks = make_sinks(2 * queries_per_kv)
    out = cpu_kernel_ops.paged_attention(*batch.args(), sliding_window=window, sinks=sinks)
    torch.testing.assert_close(out.double(), dense_attention(batch, sinks=sinks), atol=1e-2,
                               rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("codes", [torch.float8_e4m3fn, torch.int8])
def test_cpu_attention_with_sinks_over_quantized_caches(cpu_kernel_ops, dtype, codes):
    """Decodes (one split over threads), chunks and a long prefill (tiles, in bf16) over an
    int8 / fp8 cache, against the oracle with the same sinks over the de-quantized caches."""
    seqs = mixed_seqs(16) + [(300, 300), (700, 1)]
    batch = make_batch(seqs, 16, 2, 4, 64, dtype=dtype)
    key_cache, value_cache, dequantized = quantized_caches(batch, codes, cpu_kernel_ops.store_kv)
    sinks = make_sinks(8)
    out = cpu_kernel_ops.paged_attention(batch.query, key_cache, value_cache, *batch.args()[3:],
                                         sinks=sinks)
    expected = reference.paged_attention(batch.query.float(), *dequantized, *batch.args()[3:],
                                         sinks=sinks)
    assert_close(out, expected, dtype)


def test_cpu_attention_verification_rows_with_sinks_equal_their_decodes(cpu_kernel_ops):
    batch = make_batch([(700, 5)], 16, 2, 4, 64, dtype=torch.bfloat16, sliding_window=128)
    sinks = make_sinks(8)
    chunk = cpu_kernel_ops.paged_attention(*batch.args(), sliding_window=128, sinks=sinks)
    for t in range(5):
        decode = cpu_kernel_ops.paged_attention(
            batch.query[t:t + 1], batch.key_cache, batch.value_cache, batch.block_tables,
            batch.seq_lens - 4 + t, torch.tensor([0, 1], dtype=torch.int32), batch.scale,
            sliding_window=128, sinks=sinks)
        assert torch.equal(chunk[t:t + 1], decode), f"query token {t}"


def test_cpu_attention_refuses_sinks_not_one_fp32_per_head(cpu_kernel_ops):
    batch = sink_batch(16, None)
    for sinks in (make_sinks(5), make_sinks(6).bfloat16()):
        with pytest.raises(RuntimeError, match=r"sinks: contiguous fp32 \[heads\]"):
            cpu_kernel_ops.paged_attention(*batch.args(), sinks=sinks)


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(("block_size", "window"), SINK_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_attention_with_sinks_matches_dense(device, block_size, window, dtype):
    batch = sink_batch(block_size, window, dtype=dtype, device=device)
    sinks = make_sinks(6, device)
    out = triton_paged_attention(*batch.args(), sliding_window=window, sinks=sinks)
    assert_close(out, dense_attention(batch, sinks=sinks), dtype)


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("codes", [None, torch.float8_e4m3fn, torch.int8])
def test_triton_attention_with_sinks_merges_key_splits(device, codes):
    """Decodes split over programs (over a plain, fp8 or int8 cache): the merge adds the sink
    to the denominator once."""
    batch = make_batch([(200, 1), (77, 1), (9, 1)], 8, 2, 2, 64, device=device,
                       sliding_window=50)
    key_cache, value_cache = batch.key_cache, batch.value_cache
    expected_cache = key_cache.nan_to_num(0.0), value_cache.nan_to_num(0.0)
    if codes is not None:
        key_cache, value_cache, expected_cache = quantized_caches(batch, codes, triton_store_kv)
    sinks = make_sinks(4, device)
    call = AttentionCall(batch.query, key_cache, value_cache, *batch.args()[3:],
                         sliding_window=50, sinks=sinks)
    out = triton_attend(call, block_n=16, num_kv_splits=3)
    expected = reference.paged_attention(batch.query, *expected_cache, *batch.args()[3:],
                                         sliding_window=50, sinks=sinks)
    assert_close(out, expected, torch.float32)


@needs_triton
def test_triton_attention_refuses_sinks_not_one_fp32_per_head():
    batch = sink_batch(16, None)
    with pytest.raises(ValueError, match="sinks"):
        triton_paged_attention(*batch.args(), sinks=make_sinks(5))


@pytest.mark.parametrize("words", [0, 1, 31, 32, 33, 1000, 4099])
def test_the_cpu_read_words_sums_every_word_as_the_reference_does(cpu_kernel_ops, words):
    """The bandwidth probe's loop: every word once, the vector body and the tail alike, and
    the 64-bit wrap of torch's int64 sum (values near the limits make a wrong order or a
    lost word visible)."""
    generator = torch.Generator().manual_seed(words)
    data = torch.randint(-2**63, 2**63 - 1, (words,), dtype=torch.int64, generator=generator)
    assert cpu_kernel_ops.read_words(data) == reference.read_words(data)
    if words:
        data[-1] += 1
        assert cpu_kernel_ops.read_words(data) == reference.read_words(data)
