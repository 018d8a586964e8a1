"""Speed of the chat models' shapes: Qwen3-0.6B, Qwen3-1.7B, Phi-4-mini, Gemma-3-1B and the
mixtures of experts Qwen3-30B-A3B and gpt-oss-20b (sinks, windows of 128) with random
weights (values do not change the work), in bf16 and int4, against the targets of issues
28, 29 and 63.

Qwen3-30B-A3B's 48 layers (128 experts of width 768, top 8) take 61 GB in bf16: the shape
runs with as many of its layers as --max-moe-layers allows (default 2), and the output
says how many of how many. Its bandwidth limit counts what one token reads: the top-8
experts of each layer, attention, norms, routers and the output projection.

Each shape is built from transformers' own config class with the real model's sizes,
initialised at random and saved in a RAM-backed folder (/dev/shm where there is one, or
--save-dir), then measured by bench/throughput.py, each run in a process of its own (one
model in memory at a time):
  single stream   one greedy request: decode tok/s and its share of the weight-bandwidth
                  limit (measured read bandwidth / the bytes a token reads of the weights as
                  kvscope stores them, bf16 or packed int4); target >= 0.6
  batched         a random workload through kvscope and transformers' continuous batching
                  (in bf16: it has no int4, so it runs once per shape) on the same model,
                  each in a process of its own; target >= 5x; beside it the
                  ratio the machine allows at most (transformers' seconds over the
                  workload's roofline time, bench/throughput.py's roofline_seconds); and
                  per phase (prefill, decode) the milliseconds per step in the GEMMs, the
                  attention and the rest, each against its own limit, from a sampled pass
                  of its own (bench/phase_profile.py, --phase-profile-every)

Prints one JSON object: per model and quantization, the numbers above and throughput.py's
full reports.

Usage (keep it short on a shared machine):
  python bench/models.py --models qwen3-0.6b --num-requests 8 --max-output 32
  python bench/models.py                      # every shape, bf16 and int4
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch  # noqa: E402
from random_model import save_random_model
from sliding_window import gemma3_1b_config
from transformers import GptOssConfig, Phi3Config, Qwen3Config, Qwen3MoeConfig

NO_SPECIAL_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
# The published configs' sizes (config.json of Qwen/Qwen3-0.6B, Qwen/Qwen3-1.7B and
# microsoft/Phi-4-mini-instruct); Phi-4-mini's LongRoPE factors are ones here.
SHAPES = {
    "qwen3-0.6b": lambda: Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=40960, rope_theta=1000000.0, **NO_SPECIAL_TOKENS),
    "qwen3-1.7b": lambda: Qwen3Config(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=40960, rope_theta=1000000.0, **NO_SPECIAL_TOKENS),
    "phi-4-mini": lambda: Phi3Config(
        vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True,
        max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_scaling={"rope_type": "longrope", "rope_theta": 10000.0,
                      "partial_rotary_factor": 0.75, "long_factor": [1.0] * 48,
                      "short_factor": [1.0] * 48, "original_max_position_embeddings": 4096},
        **NO_SPECIAL_TOKENS),
    "gemma-3-1b": gemma3_1b_config,
    # Qwen/Qwen3-30B-A3B's config.json
    "qwen3-30b-a3b": lambda: Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False,
        max_position_embeddings=40960, rope_theta=1000000.0, **NO_SPECIAL_TOKENS),
    # openai/gpt-oss-20b's config.json (its experts dense here: bf16, or int4 when quantized)
    "gpt-oss-20b": lambda: GptOssConfig(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
        num_experts_per_tok=4, sliding_window=128, tie_word_embeddings=False,
        max_position_embeddings=131072, **NO_SPECIAL_TOKENS),
}
# Shapes too large for the machine, run with fewer layers of the same shape.
MOE_SHAPES = ("qwen3-30b-a3b", "gpt-oss-20b")
QUANTIZATIONS = ("none", "int4")
THROUGHPUT = Path(__file__).with_name("throughput.py")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES),
                        help=f"comma-separated subset of {','.join(SHAPES)}")
    parser.add_argument("--quantizations", default=",".join(QUANTIZATIONS),
                        help=f"comma-separated subset of {','.join(QUANTIZATIONS)}")
    parser.add_argument("--stream-prompt-len", type=int, default=64)
    parser.add_argument("--stream-output", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--max-output", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device-memory-gb", type=float, default=8.0,
                        help="kvscope's device_memory_gb: the CPU memory budget, weights "
                             "included (Phi-4-mini's bf16 weights take 7.2 GiB: give it 12)")
    parser.add_argument("--save-dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None,
                        help="where the random model is saved (default RAM-backed /dev/shm; a "
                             "disk folder leaves Phi-4-mini's 7.7 GB to the page cache)")
    parser.add_argument("--max-moe-layers", type=int, default=2,
                        help=f"layers of {', '.join(MOE_SHAPES)} built and measured (of 48 "
                             "and 24)")
    parser.add_argument("--phase-profile-every", type=int, default=8,
                        help="the batched run's phases profiled on every Nth step of a pass of "
                             "their own (bench/phase_profile.py); 0: off")
    parser.add_argument("--skip-batched", action="store_true",
                        help="single stream only (transformers' batching is the slow part)")
    args = parser.parse_args(argv)
    args.models = [name.strip() for name in args.models.split(",") if name.strip()]
    args.quantizations = [q.strip() for q in args.quantizations.split(",") if q.strip()]
    for flag, chosen, known in (("--models", args.models, SHAPES),
                                ("--quantizations", args.quantizations, QUANTIZATIONS)):
        unknown = sorted(set(chosen) - set(known))
        if unknown:
            parser.error(f"{flag}: unknown {unknown}; choose from {list(known)}")
    return args


def throughput_report(folder: Path, args: argparse.Namespace, quantization: str,
                      *extra: str) -> dict:
    """bench/throughput.py's JSON report, run in a process of its own."""
    command = [sys.executable, str(THROUGHPUT), "--model", str(folder), "--dtype", "bfloat16",
               "--quantization", quantization, "--repeats", str(args.repeats),
               "--device-memory-gb", str(args.device_memory_gb), *extra]
    if args.threads:
        command += ["--threads", str(args.threads)]
    return json.loads(subprocess.run(command, check=True, stdout=subprocess.PIPE,
                                     text=True).stdout)


def measure(name: str, folder: Path, args: argparse.Namespace, quantization: str,
            transformers_batched: dict | None) -> dict:
    """One shape in one quantization; transformers_batched is transformers' batched report
    on the same workload (None with --skip-batched)."""
    stream = throughput_report(
        folder, args, quantization, "--single-stream", "--backends", "kvscope",
        "--stream-prompt-len", str(args.stream_prompt_len),
        "--stream-output", str(args.stream_output))
    ours = stream["results"]["kvscope"]
    summary = {"model": name, "dtype": "bfloat16", "quantization": quantization,
               "single_stream_decode_tokens_per_s": ours["decode_tokens_per_s"],
               "share_of_bandwidth_limit": ours["share_of_bandwidth_limit"],
               "bandwidth_limit_tokens_per_s": ours["bandwidth_limit_tokens_per_s"],
               "share_of_weights_read_limit": ours.get("share_of_weights_read_limit"),
               "probe_beaten": ours["probe_beaten"],
               "single_stream_report": stream}
    if transformers_batched is not None:
        batched = throughput_report(folder, args, quantization, "--backends", "kvscope",
                                    "--phase-profile-every", str(args.phase_profile_every),
                                    *batched_workload(args))
        ours = batched["results"]["kvscope"]
        theirs = transformers_batched["results"]["hf_continuous_batching"]
        summary["batched_output_tokens_per_s"] = {
            "kvscope": ours["output_tokens_per_s"],
            "hf_continuous_batching": theirs["output_tokens_per_s"]}
        summary["batched_vs_transformers"] = round(
            ours["output_tokens_per_s"] / theirs["output_tokens_per_s"], 3)
        # What the machine allows: transformers' seconds over kvscope's steps at the GEMM
        # rate and bandwidth (bench/throughput.py's roofline_seconds).
        summary["best_possible_vs_transformers"] = round(
            theirs["seconds"] / batched["roofline_seconds"], 3)
        summary["kvscope_share_of_roofline_time"] = ours["share_of_roofline_time"]
        if "phase_profile" in batched:
            summary["phases"] = {
                name: {part: phase[part] for part in (
                    "ms_per_step", "gemm_share_of_limit", "gemm_bound",
                    "attention_share_of_limit", "rest_share_of_step")}
                for name, phase in batched["phase_profile"]["phases"].items()}
        summary["batched_report"] = batched
    return summary


def batched_workload(args: argparse.Namespace) -> tuple[str, ...]:
    """bench/throughput.py's flags for the batched workload (its fixed seed makes the same
    prompts and output lengths in every process)."""
    return ("--num-requests", str(args.num_requests), "--max-prompt", str(args.max_prompt),
            "--max-output", str(args.max_output))


def check_budget(folder: Path, args: argparse.Namespace) -> None:
    """Refuse a --device-memory-gb below the bf16 weights before transformers' run (the slow
    part) rather than at kvscope's start after it: the budget includes the weights."""
    weight_gib = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**30
    if "none" in args.quantizations and args.device_memory_gb <= weight_gib:
        sys.exit(f"--device-memory-gb={args.device_memory_gb} must exceed the model's "
                 f"{weight_gib:.2f} GiB of bf16 weights (kvscope's budget includes them)")


def main(argv=None) -> None:
    args = parse_args(argv)
    results = []
    for name in args.models:
        with tempfile.TemporaryDirectory(prefix=f"kvscope-{name}-", dir=args.save_dir) as folder:
            print(f"building a random {name} in {folder}", file=sys.stderr)
            config = SHAPES[name]()
            layers = {"layers": config.num_hidden_layers}
            if name in MOE_SHAPES and args.max_moe_layers < config.num_hidden_layers:
                layers = {"layers": args.max_moe_layers,
                          "full_model_layers": config.num_hidden_layers,
                          "note": "fewer layers of the same shape: the whole model does not "
                                  "fit this machine's memory"}
                if getattr(config, "layer_types", None):  # gpt-oss's windowed / full layers
                    config.layer_types = config.layer_types[:args.max_moe_layers]
                config.num_hidden_layers = args.max_moe_layers
            save_random_model(Path(folder), config, torch.bfloat16)
            check_budget(Path(folder), args)
            transformers_batched = None
            if not args.skip_batched:
                # Once per shape: transformers runs the model dense (it has no int4), in a
                # process of its own, so only one copy is in memory at a time.
                print(f"measuring transformers on {name}", file=sys.stderr)
                transformers_batched = throughput_report(
                    Path(folder), args, "none", "--backends", "hf_continuous_batching",
                    *batched_workload(args))
            for quantization in args.quantizations:
                print(f"measuring {name}, quantization={quantization}", file=sys.stderr)
                results.append({**measure(name, Path(folder), args, quantization,
                                          transformers_batched), **layers})
    print(json.dumps({"targets": {"share_of_bandwidth_limit": 0.6,
                                  "batched_vs_transformers": 5.0},
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()
