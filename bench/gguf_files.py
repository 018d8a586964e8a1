"""GGUF files served as they ship (quantization="gguf"), against llama.cpp on the same file.

Per file, kvscope:
  load_seconds          LLM(file, quantization="gguf") from the call to a ready engine
  weight_bytes          the memory plan's weight_bytes (and per type), against the file's
                        tensor bytes: weight_vs_file (target <= 1.25)
  single_stream_tok_s   one greedy chat reply's decode rate (bench/quantization.py's)
  batched_tok_s         bench/throughput.py's kvscope workload, --num-requests (32) at once
  perplexity            on bench/quantization.py's fixed text, one teacher-forced prefill
  share_of_bandwidth_limit  each engine's single stream against what the read bandwidth
                        (measured before each file) allows for the bytes it reads per token,
                        and the single-stream ratio that allows at most
  share_of_weights_read_limit  the same against the faster of that bandwidth and the rate a
                        reduction reads kvscope's weights at where they lie: a model that
                        fits the last-level cache streams from it faster than from memory
and, with llama-cpp-python installed (in this interpreter, or --llama-python's:
$KVSCOPE_LLAMA_PYTHON), llama.cpp in a worker process of its own (bench/llama_cpp_worker.py)
on the same file and threads: its load time, single stream, perplexity on the same tokens,
and the same requests one at a time (a user's calls) and all at once as llama-server
batches them (n_seq_max sequences, KV cache unified and per sequence), its best mode
counting; kvscope's ratios to those, and the issue's targets met or not. The two engines'
single streams alternate, one of each per round (--repeats rounds), and the single-stream
ratio is the median of the rounds' ratios: the host's speed moves between minutes.
Without llama-cpp-python the report says so and holds kvscope's numbers alone.

Files: --files PATH[,PATH...]; by default the shipped SmolLM2 Q4_1 file and, with
llama-cpp-python, its requantizations (llama_model_quantize, requantizing allowed) to
Q4_K_M, Q5_K_M, Q6_K and Q8_0 under --workdir. SmolLM2-135M's 576-wide layers are no
multiple of 256, so llama.cpp's quantizer gives those its fallbacks (Q5_0, Q5_1, Q8_0) and
only the 1536-wide ffn_down the k-quant itself: the per-type bytes in the report say which.
--random-shape HIDDEN,FFN,LAYERS,HEADS,KV_HEADS starts instead from a Llama of that shape
with random F16 weights and the shipped file's tokenizer (1024,3072,28,16,8 is about
Qwen3-0.6B's size), whose widths take every k-quant; its perplexities compare the two
engines' arithmetic, not a model's quality.

--random-moe-shape qwen3-30b-a3b starts from Qwen3-30B-A3B's shape (bench/models.py's:
128 experts of width 768, top 8, hidden 2048, 32 / 4 heads of 128) with --max-moe-layers of
its 48 layers (default 2: the whole model does not fit this machine's memory; the report
says so) and the shipped file's tokenizer (its 49,152 tokens, not Qwen's 151,936), written
directly as random valid blocks in two mixes (random_moe_gguf): Q4_K_M's as llama.cpp's
quantizer makes it and Q8_0. Its bandwidth limit counts the bytes a token reads: the top 8
experts of each layer (gguf_bytes_per_step; kvscope's memory plan less the unchosen
experts).

Usage:
  flock /work/bench.lock python bench/gguf_files.py   (not bench/gguf.py: that name
  would shadow the gguf package for every script run from bench/)
  python bench/gguf_files.py --files model.Q4_K_M.gguf --num-requests 32 --single-tokens 64
  python bench/gguf_files.py --random-shape 1024,3072,28,16,8
  python bench/gguf_files.py --random-moe-shape qwen3-30b-a3b --max-moe-layers 2 --skip-batched
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import numpy as np
import roofline  # noqa: E402
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType
from quantization import TEXT, batched, perplexity, single_stream  # noqa: E402
from served import cpu_name  # noqa: E402
from throughput import LlamaCpp, default_llama_python, llama_cpp_available, make_workload  # noqa: E402
from throughput import parse_args as throughput_args  # noqa: E402

from kvscope import LLM  # noqa: E402
from kvscope.engine.worker.gguf_weights import gguf_tensor_bytes_by_type  # noqa: E402
from kvscope.engine.worker.loader import find_default_gguf  # noqa: E402
from kvscope.engine.worker.memory_bandwidth import weights_read_bandwidth  # noqa: E402
from kvscope.kernels.gguf_blocks import random_blocks  # noqa: E402

# llama.cpp's file types (llama.h's enum llama_ftype) the default run requantizes into.
REQUANTIZED = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7}
QUANTIZE = """
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.allow_requantize = True
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(),
                                        ctypes.byref(params)))
"""


def random_shaped_gguf(workdir: Path, shape: str) -> Path:
    """A Llama GGUF of `shape` (HIDDEN,FFN,LAYERS,HEADS,KV_HEADS) with random F16 weights
    and the shipped file's tokenizer and chat template (values do not change the work)."""
    hidden, ffn, layers, heads, kv_heads = (int(value) for value in shape.split(","))
    path = workdir / f"random-llama-{hidden}x{ffn}x{layers}x{heads}x{kv_heads}.F16.gguf"
    if path.is_file():
        return path
    source = GGUFReader(find_default_gguf())
    vocab = int(source.fields["llama.vocab_size"].contents())
    writer = GGUFWriter(path, "llama")
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(100000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            writer.add_key_value(key, field.contents(), field.types[0],
                                 field.types[-1] if len(field.types) > 1 else None)
    generator = np.random.default_rng(0)

    def weight(rows: int, columns: int) -> np.ndarray:
        values = generator.standard_normal((rows, columns), dtype=np.float32)
        return (values / columns ** 0.5).astype(np.float16)

    norm = np.ones(hidden, dtype=np.float32)
    kv_width = kv_heads * (hidden // heads)
    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    writer.add_tensor("output_norm.weight", norm)
    for layer in range(layers):
        for name, tensor in (("attn_norm", norm), ("attn_q", weight(hidden, hidden)),
                             ("attn_k", weight(kv_width, hidden)),
                             ("attn_v", weight(kv_width, hidden)),
                             ("attn_output", weight(hidden, hidden)), ("ffn_norm", norm),
                             ("ffn_gate", weight(ffn, hidden)), ("ffn_up", weight(ffn, hidden)),
                             ("ffn_down", weight(hidden, ffn))):
            writer.add_tensor(f"blk.{layer}.{name}.weight", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


Q = GGMLQuantizationType
# Qwen/Qwen3-30B-A3B's shape (bench/models.py's SHAPES): hidden, expert width, experts, top k,
# heads, KV heads, head size, layers.
MOE_SHAPES = {"qwen3-30b-a3b": {"hidden": 2048, "width": 768, "experts": 128, "top_k": 8,
                                "heads": 32, "kv_heads": 4, "head_dim": 128, "layers": 48}}
# The types of a MoE file's tensors per mix: llama.cpp's Q4_K_M keeps attn_v and ffn_down in
# Q6_K on half the layers (its use_more_bits picks 24 of 48; here every other layer) and the
# output in Q6_K, the rest in Q4_K; Q8_0 everything. Norms and routers stay F32, as there.
MOE_MIXES = {
    "Q4_K_M": lambda name, layer: (Q.Q6_K if name == "output" or (
        name in ("attn_v", "ffn_down_exps") and layer % 2 == 0) else Q.Q4_K),
    "Q8_0": lambda name, layer: Q.Q8_0,
}


def random_moe_gguf(workdir: Path, shape: str, layers: int, mix: str) -> Path:
    """A Qwen3-MoE GGUF of MOE_SHAPES[shape] with `layers` layers, every matrix random valid
    blocks of MOE_MIXES[mix] (values do not change the work), with the shipped file's
    tokenizer and chat template."""
    size = MOE_SHAPES[shape]
    path = workdir / f"random-{shape}-{layers}-layers.{mix}.gguf"
    if path.is_file():
        return path
    source = GGUFReader(find_default_gguf())
    vocab = int(source.fields["llama.vocab_size"].contents())
    hidden, width, experts = size["hidden"], size["width"], size["experts"]
    q_width, kv_width = size["heads"] * size["head_dim"], size["kv_heads"] * size["head_dim"]
    writer = GGUFWriter(path, "qwen3moe")
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(6144)
    writer.add_expert_feed_forward_length(width)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(size["top_k"])
    writer.add_head_count(size["heads"])
    writer.add_head_count_kv(size["kv_heads"])
    writer.add_key_length(size["head_dim"])
    writer.add_value_length(size["head_dim"])
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            writer.add_key_value(key, field.contents(), field.types[0],
                                 field.types[-1] if len(field.types) > 1 else None)
    generator = np.random.default_rng(0)
    kind_of = MOE_MIXES[mix]

    def blocks(name: str, layer: int, *shape: int) -> None:
        kind = kind_of(name.split(".")[-1], layer)
        rows = random_blocks(kind, int(np.prod(shape[:-1])), shape[-1], generator)
        full = f"blk.{layer}.{name}.weight" if layer >= 0 else f"{name}.weight"
        writer.add_tensor(full, rows.reshape(*shape[:-1], -1), raw_dtype=kind)

    def dense(name: str, values: np.ndarray) -> None:
        writer.add_tensor(name, values.astype(np.float32))

    blocks("token_embd", -1, vocab, hidden)
    dense("output_norm.weight", np.ones(hidden))
    blocks("output", -1, vocab, hidden)
    for layer in range(layers):
        dense(f"blk.{layer}.attn_norm.weight", np.ones(hidden))
        dense(f"blk.{layer}.ffn_norm.weight", np.ones(hidden))
        dense(f"blk.{layer}.attn_q_norm.weight", np.ones(size["head_dim"]))
        dense(f"blk.{layer}.attn_k_norm.weight", np.ones(size["head_dim"]))
        dense(f"blk.{layer}.ffn_gate_inp.weight",
              generator.standard_normal((experts, hidden)) / hidden ** 0.5)
        blocks("attn_q", layer, q_width, hidden)
        blocks("attn_k", layer, kv_width, hidden)
        blocks("attn_v", layer, kv_width, hidden)
        blocks("attn_output", layer, hidden, q_width)
        blocks("ffn_gate_exps", layer, experts, width, hidden)
        blocks("ffn_up_exps", layer, experts, width, hidden)
        blocks("ffn_down_exps", layer, experts, hidden, width)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def default_files(workdir: Path, llama_python: str | None, source: Path) -> list[Path]:
    """`source`, and its requantizations where llama-cpp-python runs."""
    files = [source]
    if llama_python is not None:
        for name, ftype in REQUANTIZED.items():
            target = workdir / f"{source.stem.rsplit('.', 1)[0]}.{name}.gguf"
            if not target.is_file():
                subprocess.run([llama_python, "-c", QUANTIZE, str(source), str(target), str(ftype)],
                               check=True)
            files.append(target)
    return files


def load_kvscope(path: Path, args: argparse.Namespace, text: str) -> tuple[LLM, dict, list[int]]:
    """kvscope on the file, its load and bytes, and the perplexity's tokens."""
    started = time.perf_counter()
    llm = LLM(str(path), quantization="gguf", dtype=args.dtype)
    load_seconds = time.perf_counter() - started
    plan = llm.engine.memory_plan
    on_file = gguf_tensor_bytes_by_type(path)
    tokens = llm.get_tokenizer()(text, add_special_tokens=False)["input_ids"][:args.ppl_tokens]
    # What a token reads: a MoE model's unchosen experts stay unread, and so does an
    # embedding table the logits do not read (a lookup reads one row of it).
    layout = llm.engine.expert_layout
    unread = 0 if layout is None else sum(size * (layout.num_experts - layout.top_k)
                                          for size in layout.bytes_per_expert)
    model = llm.engine.runner.model
    if not model.tied:
        unread += sum(p.numel() * p.element_size() for p in model.model.embed_tokens.parameters())
    row = {"load_seconds": round(load_seconds, 1),
           "weight_bytes": plan.weight_bytes, "weight_bytes_by_type": plan.weight_bytes_by_type,
           "weight_bytes_per_token": plan.weight_bytes - unread,
           "file_tensor_bytes": sum(on_file.values()), "file_tensor_bytes_by_type": on_file,
           "weight_vs_file": round(plan.weight_bytes / sum(on_file.values()), 3)}
    return llm, row, tokens


def finish_kvscope(llm: LLM, row: dict, args: argparse.Namespace, tokens: list[int]) -> None:
    row["perplexity"] = round(perplexity(llm, tokens, len(tokens)), 3)
    row["perplexity_tokens"] = len(tokens)
    if not args.skip_batched:
        row["batched"] = batched(llm, args)
        row["batched_tok_s"] = row["batched"]["output_tokens_per_s"]


def load_llama_cpp(path: Path, args: argparse.Namespace, llm_tokenizer) -> tuple[LlamaCpp, list[int]]:
    """llama.cpp's worker on the file, and the prompt of its single streams."""
    workload_args = throughput_args(["--backends", "llama_cpp", "--num-requests",
                                     str(args.num_requests), "--max-prompt", str(args.max_prompt),
                                     "--max-output", str(args.max_output),
                                     "--llama-python", args.llama_python])
    workload = make_workload(workload_args, llm_tokenizer, llm_tokenizer.vocab_size)
    return LlamaCpp(workload_args, workload, path, gguf=path), workload.prompts[0]


def finish_llama_cpp(backend: LlamaCpp, row: dict, args: argparse.Namespace,
                     tokens: list[int]) -> None:
    row["load_seconds"] = round(backend.setup_seconds, 1)
    row["weight_bytes_per_step"] = backend.weight_bytes_per_step()
    row["perplexity"] = round(backend.perplexity(tokens), 3)
    if not args.skip_batched:
        modes = {"one_at_a_time": backend.run(), "server_unified_kv": backend.batched(True),
                 "server_kv_per_sequence": backend.batched(False)}
        best = max(modes, key=lambda mode: modes[mode]["output_tokens_per_s"])
        row["batched"] = modes
        row["batched_best_mode"] = best
        row["batched_tok_s"] = modes[best]["output_tokens_per_s"]
    backend.worker.stdin.close()
    backend.worker.wait()


def single_streams_in_rounds(llm: LLM, backend: LlamaCpp | None, prompt: list[int],
                             args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Each engine's single stream --repeats times, one of each per round, so that every
    round's two runs meet the host in about the same state: its speed moves a lot between
    minutes (docs/performance.md, 'How to read these numbers'), and runs of one engine and
    then the other would read that as a ratio."""
    ours, theirs = [], []
    for _ in range(args.repeats):
        ours.append(single_stream(llm, args.single_tokens))
        if backend is not None:
            theirs.append(backend.single_stream(prompt, args.single_tokens))
    return ours, theirs


# The targets per ratio (ratios()): the test and the target as text.
TARGETS = {"single_stream_vs_llama_cpp": (lambda r: r >= 1.8, ">= 1.8"),
           "weight_vs_file": (lambda r: r <= 1.25, "<= 1.25"),
           "batched_vs_llama_cpp_best": (lambda r: r >= 2.0, ">= 2"),
           "perplexity_vs_llama_cpp": (lambda r: abs(r - 1) <= 0.01, "within 1 %")}


def ratios(ours: dict, theirs: dict | None) -> dict:
    """kvscope over llama.cpp per measure, and the weight bytes over the file's. The single
    stream's is the median of the rounds' ratios (single_streams_in_rounds); the ratio of
    the two best runs, which may come from different minutes, is reported beside it."""
    out = {"weight_vs_file": ours["weight_vs_file"]}
    if theirs is not None:
        for name, key in (("single_stream_best_vs_best", "single_stream_tok_s"),
                          ("batched_vs_llama_cpp_best", "batched_tok_s"),
                          ("perplexity_vs_llama_cpp", "perplexity"),
                          ("load_seconds_vs_llama_cpp", "load_seconds")):
            if key in ours and key in theirs:
                out[name] = round(ours[key] / theirs[key], 3)
        rounds = [a["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                  for a, b in zip(ours["single_stream"], theirs["single_stream"])]
        out["single_stream_by_round"] = [round(r, 3) for r in rounds]
        out["single_stream_vs_llama_cpp"] = round(statistics.median(rounds), 3)
    return out


def bandwidth_shares(ours: dict, theirs: dict | None, bandwidth: float) -> dict:
    """Each engine's single stream over the rate at which `bandwidth` could stream the weight
    bytes it reads per token (kvscope: the memory plan's weight bytes, a MoE model's chosen
    experts only; llama.cpp: the file's tensors as stored, gguf_bytes_per_step). No engine
    can beat llama.cpp by more than the inverse of llama.cpp's share."""
    shares = {"kvscope": round(ours["single_stream_tok_s"] * ours["weight_bytes_per_token"]
                               / bandwidth, 3)}
    if theirs is not None:
        shares["llama_cpp"] = round(theirs["single_stream_tok_s"] * theirs["weight_bytes_per_step"]
                                    / bandwidth, 3)
        shares["single_stream_vs_llama_cpp_at_most"] = round(1 / shares["llama_cpp"], 3)
    return shares


def targets(measured: dict) -> dict:
    return {name: {"target": text, "measured": measured[name], "met": test(measured[name])}
            for name, (test, text) in TARGETS.items() if name in measured}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", default=None, help="comma-separated GGUF paths")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "kvscope-gguf-bench"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--single-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ppl-tokens", type=int, default=512)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=128)
    parser.add_argument("--max-output", type=int, default=64)
    parser.add_argument("--skip-batched", action="store_true")
    parser.add_argument("--random-shape", default=None,
                        help="HIDDEN,FFN,LAYERS,HEADS,KV_HEADS: start from a random Llama of "
                             "this shape instead of the shipped file")
    parser.add_argument("--random-moe-shape", default=None, choices=list(MOE_SHAPES),
                        help="start from random blocks of this MoE shape, in Q4_K_M's and "
                             "Q8_0's mixes, instead of the shipped file")
    parser.add_argument("--max-moe-layers", type=int, default=2,
                        help="layers of --random-moe-shape written and measured")
    parser.add_argument("--llama-python", default=default_llama_python(),
                        help="the interpreter with llama-cpp-python (default: "
                             "$KVSCOPE_LLAMA_PYTHON, else this one)")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    with_llama_cpp = llama_cpp_available(args.llama_python)
    source = (random_shaped_gguf(workdir, args.random_shape) if args.random_shape
              else find_default_gguf())
    if args.files:
        files = [Path(f) for f in args.files.split(",")]
    elif args.random_moe_shape:
        files = [random_moe_gguf(workdir, args.random_moe_shape, args.max_moe_layers, mix)
                 for mix in MOE_MIXES]
    else:
        files = default_files(workdir, args.llama_python if with_llama_cpp else None, source)
    text = TEXT.read_text()
    report = {"torch_threads": torch.get_num_threads(), "cpu": cpu_name(),
              "machine": platform.processor() or platform.machine(), "files": {}}
    if args.random_moe_shape:
        full = MOE_SHAPES[args.random_moe_shape]["layers"]
        report["layers"] = {"layers": args.max_moe_layers, "full_model_layers": full}
        if args.max_moe_layers < full:
            report["layers"]["note"] = ("fewer layers of the same shape: the whole model does "
                                        "not fit this machine's memory")
    if not with_llama_cpp:
        report["llama_cpp"] = (f"llama-cpp-python is not installed for {args.llama_python} (it "
                               "is built from source: see docs/benchmarks.md; --llama-python names a "
                               "venv that has it), so no requantized k-quant files and no "
                               "llama.cpp numbers; kvscope alone")
    for path in files:
        # Measured again by each file: the host's memory speed moves between minutes.
        bandwidth = max(roofline.read_bandwidths().values())
        llm, ours, tokens = load_kvscope(path, args, text)
        # A model that fits the last-level cache streams from it faster than from memory:
        # the rate a reduction reads kvscope's weights at where they lie bounds that too.
        weights_rate = weights_read_bandwidth(llm.engine.runner.model.parameters())
        backend = prompt = theirs = None
        if with_llama_cpp:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            backend, prompt = load_llama_cpp(path, args, tokenizer)
        ours["single_stream"], their_streams = single_streams_in_rounds(llm, backend, prompt, args)
        ours["single_stream_tok_s"] = max(run["decode_tokens_per_s"] for run in ours["single_stream"])
        finish_kvscope(llm, ours, args, tokens)
        row = {"kvscope": ours}
        if backend is not None:
            theirs = row["llama_cpp"] = {
                "single_stream": their_streams,
                "single_stream_tok_s": max(run["decode_tokens_per_s"] for run in their_streams)}
            finish_llama_cpp(backend, theirs, args, tokens)
        row["ratios"] = ratios(ours, theirs)
        row["targets"] = targets(row["ratios"])
        row["read_bandwidth_gb_s"] = round(bandwidth / 1e9, 2)
        row["share_of_bandwidth_limit"] = bandwidth_shares(ours, theirs, bandwidth)
        row["weights_read_bandwidth_gb_s"] = round(weights_rate / 1e9, 2)
        row["share_of_weights_read_limit"] = bandwidth_shares(ours, theirs,
                                                              max(bandwidth, weights_rate))
        report["files"][path.name] = row
        print(json.dumps({path.name: row["ratios"]}), file=sys.stderr)
        del llm
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
