"""Shared fixtures: tiny random models made on the fly (no downloads)."""

# kvscope before transformers: importing it keeps the repository's own top-level folders from
# hiding installed packages of the same name (kvscope/__init__.py), and transformers imports
# Hugging Face's `kernels` where that is installed.
import kvscope  # noqa: F401, I001

import base64
import itertools
import os
import socket
import string
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import uvicorn

if not torch.cuda.is_available():
    # The Triton kernels run interpreted on CPU tensors (tests/test_kernels.py). Triton
    # fixes the mode of every @triton.jit function, its own library's included, when it is
    # imported, and transformers imports it below, so this must come first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    Gemma4TextConfig,
    GptOssConfig,
    Lfm2Config,
    LlamaConfig,
    LlamaForCausalLM,
    Ministral3Config,
    MistralConfig,
    MixtralConfig,
    Olmo3Config,
    OlmoeConfig,
    OPTConfig,
    Phi3Config,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.request import Request, Sequence
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.records import StepRecord
from kvscope.engine.worker.model_runner import ModelRunner
from kvscope.kernels import cpu_kernels, cpu_kernels_required


def pytest_collection_modifyitems(items) -> None:
    """Tests that drive headless Chromium (named test_browser_*, or using a `browser`
    fixture) are marked `browser`, so `make test-fast` can leave them out."""
    for item in items:
        if item.name.startswith("test_browser") or "browser" in getattr(item, "fixturenames",
                                                                          ()):
            item.add_marker(pytest.mark.browser)


# A test that ran the C++ kernels of a build records it so (record_property); the run's
# summary then says which CPU paths ran (tests/test_cpu_paths.py).
CPU_PATH_PROPERTY = "cpu_kernel_path"


def pytest_terminal_summary(terminalreporter) -> None:
    """One line naming the builds of the C++ kernels whose tests ran, and how they ended."""
    paths = [value if outcome == "passed" else f"{value}: {outcome.upper()}"
             for outcome in ("passed", "failed", "skipped")
             for report in terminalreporter.stats.get(outcome, [])
             for name, value in getattr(report, "user_properties", ())
             if name == CPU_PATH_PROPERTY]
    if paths:
        terminalreporter.write_line("C++ CPU kernel paths run against the reference: "
                                    + "; ".join(sorted(paths)))


@pytest.fixture(scope="session")
def cpu_kernel_ops():
    """The C++ kernels' record, built (or loaded from the cache) once. Where they cannot be
    built the tests that need them skip, unless KVSCOPE_REQUIRE_CPU_KERNELS is set (as
    `make test` sets it): then they fail, with the build's error."""
    try:
        return cpu_kernels.kernel_ops()
    except RuntimeError as error:
        if cpu_kernels_required():
            raise
        pytest.skip(f"C++ CPU kernels cannot be built here: {error}")


# SmolLM2's ChatML layout, so chat code paths see the same special tokens as the default model.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tiny_chat_model(folder: Path) -> Path:
    """A 2-layer random Llama with a one-character-per-token tokenizer and a chat template.

    Every token decodes to a printable character, so streamed text is never held back
    as a half-finished multi-byte character.
    """
    characters = sorted(set(string.printable) - set("\r\x0b\x0c"))
    core = Tokenizer(models.BPE(vocab=_chat_vocab(characters), merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    return _save_chat_llama(folder, core)


CHAT_SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1 (BOS) and 2 (EOS)


def _chat_vocab(symbols: list[str]) -> dict[str, int]:
    return {token: index for index, token in enumerate(CHAT_SPECIALS + symbols)}


def _save_chat_llama(folder: Path, core: Tokenizer, **tokenizer_kwargs) -> Path:
    """Save `core` as a chat tokenizer (ChatML template) beside a 2-layer random Llama."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<|im_start|>",
        eos_token="<|im_end|>", pad_token="<unk>", **tokenizer_kwargs)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=core.get_vocab_size(), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", autouse=True)
def private_profile_cache(tmp_path_factory):
    """Profiling results of the tests' throwaway models stay out of the user's cache."""
    os.environ["KVSCOPE_PROFILE_CACHE"] = str(tmp_path_factory.mktemp("profiles"))


@pytest.fixture(scope="session")
def tiny_chat_model_path(tmp_path_factory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-llama"))


# ---- tiny random models of every architecture for the engine tests -----------------------
# Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's
# spinning workers made each engine step 10-50x slower. Tests of real-sized models may
# restore DEFAULT_NUM_THREADS.
DEFAULT_NUM_THREADS = torch.get_num_threads()
torch.set_num_threads(1)
TINY_VOCAB_SIZE = 256
TINY_MAX_POSITIONS = 256
TINY_ARCHITECTURES = ("llama", "qwen2", "opt", "llama3", "qwen3", "smollm3", "phi3", "ministral3")
RANDOM_NORM_ARCHITECTURES = ("qwen3", "smollm3", "phi3", "phi3-window", "olmo3", "gemma4",
                             "qwen3-moe", "olmoe", "lfm2", "qwen3_5", "qwen3_5-moe")
# Sliding-window twins (window 8, so most test prompts outrun it): every Mistral and Phi-3
# layer windowed; Qwen2 with its first layer global and the second windowed.
TINY_WINDOW = 8
# Gemma 3 (two sliding layers, one global, q/k norms, two rope bases), Gemma 2 (soft caps
# small enough that random weights reach them), Olmo 3 (sliding and full layers, a rope
# each, post-norms) and Gemma 4 (layers of two shapes, per-layer inputs, shared KV caches).
SLIDING_WINDOW_ARCHITECTURES = ("mistral-window", "qwen2-window", "phi3-window", "gemma3", "gemma2",
                                "olmo3", "gemma4")
# Mixtures of experts (8 experts, top 2 or 3): Qwen3-MoE with a dense MLP layer between MoE
# ones (mlp_only_layers) and renormalized top-k; OLMoE (q/k norms over whole projections);
# Mixtral; Qwen2-MoE (a gated shared expert; decoder_sparse_step 2 makes its first layer
# dense).
MOE_ARCHITECTURES = ("qwen3-moe", "olmoe", "mixtral", "qwen2-moe", "gpt-oss")
# Recurrent layers beside attention, their state in slots (engine.core.state_slots): LFM2
# (short convolutions around one GQA layer), Qwen3.5 and Qwen3.5-MoE (three Gated DeltaNet
# layers, then a gated full-attention one).
RECURRENT_ARCHITECTURES = ("lfm2", "qwen3_5", "qwen3_5-moe")


@dataclass
class TinyModel:
    """A tiny random model saved as a Hugging Face folder, and the transformers model itself
    (the parity oracle). Token `i` is the word `<i>`, so text and ids map one to one."""

    arch: str
    path: Path
    hf_model: PreTrainedModel


def _tiny_config(arch: str):
    common = {"vocab_size": TINY_VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "max_position_embeddings": TINY_MAX_POSITIONS,
              "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if arch == "llama":  # GQA and an untied output projection
        return LlamaConfig(intermediate_size=128, num_key_value_heads=2,
                           tie_word_embeddings=False, **common)
    if arch == "qwen2":  # qkv bias and tied embeddings
        return Qwen2Config(intermediate_size=128, num_key_value_heads=2,
                           tie_word_embeddings=True, **common)
    if arch == "mistral-window":
        return MistralConfig(intermediate_size=128, num_key_value_heads=2,
                             sliding_window=TINY_WINDOW, tie_word_embeddings=False, **common)
    if arch == "qwen2-window":
        return Qwen2Config(intermediate_size=128, num_key_value_heads=2,
                           use_sliding_window=True, sliding_window=TINY_WINDOW,
                           max_window_layers=1, tie_word_embeddings=True, **common)
    if arch in ("gemma3", "gemma2"):
        gemma = {"intermediate_size": 128, "num_key_value_heads": 2, "head_dim": 16,
                 "sliding_window": TINY_WINDOW, "query_pre_attn_scalar": 24,
                 "tie_word_embeddings": False, **common, "num_hidden_layers": 3}
        if arch == "gemma3":
            config = Gemma3TextConfig(
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                 "full_attention": {"rope_type": "default",
                                                    "rope_theta": 1000.0}}, **gemma)
        else:
            # weights large enough that the scores and logits reach their caps
            config = Gemma2Config(attn_logit_softcapping=2.0, final_logit_softcapping=8.0,
                                  initializer_range=0.3,
                                  **gemma)
        config._attn_implementation = "eager"  # transformers' reference path for soft caps
        return config
    if arch == "opt":
        return OPTConfig(ffn_dim=128, word_embed_proj_dim=64, **common)
    # The new architectures' weights are drawn wider than transformers' default (0.02),
    # so attention is far from uniform and a position or a norm misapplied changes tokens.
    common = {**common, "initializer_range": 0.2}
    if arch == "llama3":  # Llama 3.2: llama3 rope scaling, tied embeddings
        return LlamaConfig(intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=True,
                           rope_scaling={"rope_type": "llama3", "rope_theta": 500000.0,
                                         "factor": 32.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64}, **common)
    if arch == "qwen3":  # per-head q/k norms; head_dim wider than hidden / heads
        return Qwen3Config(intermediate_size=128, num_key_value_heads=2, head_dim=32,
                           tie_word_embeddings=False, **common)
    if arch == "smollm3":  # a NoPE layer (no rotary) after rotary ones; tied embeddings.
        # Four layers, so the NoPE one is where llama.cpp's SmolLM3 puts it (every 4th: a GGUF
        # stores no list of them)
        return SmolLM3Config(intermediate_size=128, num_key_value_heads=2,
                             no_rope_layers=[1, 1, 1, 0], tie_word_embeddings=True,
                             **{**common, "num_hidden_layers": 4})
    if arch in MOE_ARCHITECTURES:
        return _tiny_moe_config(arch, {**common, "num_hidden_layers": 3})
    if arch in ("phi3", "phi3-window"):  # fused qkv / gate_up, partial rotary, LongRoPE (its
        # short factors here: transformers takes the long ones only past
        # original_max_position_embeddings) with an attention factor scaling cos and sin; the
        # window as Phi-3-mini-4k's config sets one (2047 there)
        return Phi3Config(intermediate_size=128, num_key_value_heads=2,
                          tie_word_embeddings=False,
                          sliding_window=TINY_WINDOW if arch == "phi3-window" else None, **common,
                          **phi3_rope(common, attention_factor=1.25))
    if arch == "olmo3":  # a full layer between sliding ones, yarn on the full one only; q/k
        # norms over the whole projections; norms after attention and the MLP, none before
        return Olmo3Config(
            intermediate_size=128, num_key_value_heads=2, sliding_window=TINY_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                             "full_attention": {"rope_type": "yarn", "rope_theta": 1000.0,
                                                "factor": 4.0,
                                                "original_max_position_embeddings": 64}},
            tie_word_embeddings=False, **{**common, "num_hidden_layers": 3})
    if arch == "ministral3":  # yarn, and queries scaled up by position from
        # original_max_position_embeddings on (16: the parity prompts reach five times it)
        return Ministral3Config(
            intermediate_size=128, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
                             "original_max_position_embeddings": 16, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "llama_4_scaling_beta": 0.5}, **common)
    if arch == "gemma4":  # every part a real Gemma 4 has (but experts): full layers of their
        # own shape (head_dim 48, one KV head, values from the key projection) with
        # proportional rope; per-layer inputs; the last two layers sharing the first two's K/V
        # (with double-wide MLPs); soft-capped logits
        return Gemma4TextConfig(
            intermediate_size=128, num_key_value_heads=2, head_dim=16, global_head_dim=48,
            num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=TINY_WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                             "full_attention": {"rope_type": "proportional", "rope_theta": 1000.0,
                                                "partial_rotary_factor": 0.25}},
            hidden_size_per_layer_input=32, vocab_size_per_layer_input=TINY_VOCAB_SIZE,
            num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=8.0,
            tie_word_embeddings=True,
            # transformers' own scale: wider weights make this model repeat one token
            **{**common, "num_hidden_layers": 4, "initializer_range": 0.02})
    if arch == "lfm2":  # conv layers around a GQA layer with q/k norms; an MLP width
        # adjusted as LFM2's (2/3, rounded up to block_multiple_of); conv biases
        return Lfm2Config(
            intermediate_size=192, num_key_value_heads=2, conv_L_cache=3, conv_bias=True,
            layer_types=["conv", "full_attention", "conv", "conv"], block_multiple_of=32,
            tie_word_embeddings=True, **{**common, "num_hidden_layers": 4})
    if arch in ("qwen3_5", "qwen3_5-moe"):  # two value heads per key head in the delta
        # rule; a quarter of each attention head rotated (transformers' default)
        qwen3_5 = {"num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                   "tie_word_embeddings": False, **common, "num_hidden_layers": 4}
        if arch == "qwen3_5":
            return Qwen3_5TextConfig(intermediate_size=128, **qwen3_5)
        return Qwen3_5MoeTextConfig(num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=32,
                                    shared_expert_intermediate_size=64, **qwen3_5)
    raise ValueError(arch)


def _tiny_moe_config(arch: str, common: dict):
    moe = {"num_key_value_heads": 2, "num_experts_per_tok": 2, "tie_word_embeddings": False,
           **common}
    if arch == "qwen3-moe":
        return Qwen3MoeConfig(num_experts=8, moe_intermediate_size=32, intermediate_size=96,
                              head_dim=32, norm_topk_prob=True, mlp_only_layers=[1], **moe)
    if arch == "olmoe":
        return OlmoeConfig(num_experts=8, intermediate_size=32, norm_topk_prob=False,
                           **{**moe, "num_experts_per_tok": 3})
    if arch == "mixtral":
        return MixtralConfig(num_local_experts=8, intermediate_size=32, **moe)
    if arch == "gpt-oss":
        # Windowed and full layers, yarn rope, sinks, biases everywhere; weights large enough
        # that the swiglu's clamps bite (the default 0.02 never reaches its limit of 7), and an
        # expert width whose gate_up (128) differs from hidden_size, as a fused tensor's
        # [experts, in, out] layout must not be read the other way round.
        return GptOssConfig(
            num_local_experts=8, intermediate_size=64, head_dim=16, sliding_window=TINY_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": TINY_MAX_POSITIONS // 4},
            **{**moe, "initializer_range": 0.3, "num_hidden_layers": 2})
    return Qwen2MoeConfig(num_experts=8, moe_intermediate_size=32, intermediate_size=96,
                          shared_expert_intermediate_size=64, decoder_sparse_step=2, **moe)


def phi3_rope(common: dict, original_max_position_embeddings: int | None = None,
              **rope_parameters) -> dict:
    """Phi-4-mini's rotary layout at tiny size: 3/4 of each head rotated, LongRoPE with
    distinct short and long factors per rotated pair."""
    partial = 0.75
    pairs = int(common["hidden_size"] // common["num_attention_heads"] * partial) // 2
    original = original_max_position_embeddings or common["max_position_embeddings"]
    return {"original_max_position_embeddings": original,
            "rope_scaling": {"rope_type": "longrope", "rope_theta": 10000.0,
                             "partial_rotary_factor": partial,
                             "short_factor": [1.0 + 0.25 * i for i in range(pairs)],
                             "long_factor": [2.0 + 0.5 * i for i in range(pairs)],
                             "original_max_position_embeddings": original,
                             **rope_parameters}}


def save_tiny_model(arch: str, folder: Path) -> TinyModel:
    """No EOS token: generation runs to max_tokens in both engines unless a test asks."""
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(_tiny_config(arch), dtype=torch.float32).eval()
    if arch in RANDOM_NORM_ARCHITECTURES:
        # Norm weights start as ones, under which a norm's weight loaded into the wrong
        # place (a q_norm as the k_norm) changes nothing.
        with torch.no_grad():
            for name, parameter in hf_model.named_parameters():
                if "norm" in name:
                    parameter.uniform_(0.5, 1.5)
            for name, buffer in hf_model.named_buffers():
                if name.endswith("layer_scalar"):  # Gemma 4's, saved with the weights
                    buffer.uniform_(0.5, 1.5)
    save_tiny_model_files(hf_model, folder)
    return TinyModel(arch, folder, hf_model)


def save_tiny_model_files(hf_model: PreTrainedModel, folder: Path) -> None:
    """The model's safetensors and config, and the tiny word-level tokenizer."""
    hf_model.save_pretrained(folder)
    vocab = {f"<{i}>": i for i in range(TINY_VOCAB_SIZE)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core).save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Callable[[str], TinyModel]:
    """tiny_model(arch), arch one of TINY_ARCHITECTURES: made once per session."""
    made: dict[str, TinyModel] = {}

    def get(arch: str) -> TinyModel:
        if arch not in made:
            made[arch] = save_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return made[arch]

    return get


@pytest.fixture(scope="session")
def make_engine(tiny_model) -> Callable[..., EngineCore]:
    """make_engine(arch, **knobs): a fresh float32 CPU EngineCore on the tiny model.

    Engines of one architecture share the loaded weights (one ModelRunner), and each new
    engine re-binds the runner's KV cache, so only the latest engine of an architecture
    may be used.
    """
    runners: dict[str, ModelRunner] = {}

    def make(arch: str, **knobs) -> EngineCore:
        base = {"model": str(tiny_model(arch).path), "dtype": "float32", "device": "cpu",
                "device_memory_gb": 0.05}
        if arch not in runners:
            # Without the knobs: the runner sizes its position tables by max_model_len,
            # and later engines on it may ask for more than this first one.
            runners[arch] = ModelRunner(EngineConfig(**base))
        return EngineCore(EngineConfig(**base, **knobs), runner=runners[arch])

    return make


@pytest.fixture(scope="session")
def eager_engine(tiny_model) -> Callable[..., EngineCore]:
    """eager_engine(arch, **knobs): as make_engine, on a runner of its own that keeps the
    layers (make_engine's shared runner fuses the decoder stack)."""
    runners: dict[str, ModelRunner] = {}

    def make(arch: str, **knobs) -> EngineCore:
        base = {"model": str(tiny_model(arch).path), "dtype": "float32", "device": "cpu",
                "device_memory_gb": 0.05, "enforce_eager": True}
        if arch not in runners:
            runners[arch] = ModelRunner(EngineConfig(**base))
        return EngineCore(EngineConfig(**base, **knobs), runner=runners[arch])

    return make


_sequence_ids = itertools.count()


def session_log_round_trip(records: list[StepRecord], config: dict,
                           folder: Path) -> list[StepRecord]:
    """The step records as a session log in `folder` stores and reads them back."""
    from kvscope.storage import SessionLog
    from kvscope.storage.reader import load_session
    from kvscope.storage.schema import open_database

    log = SessionLog(folder / "log.db")
    session_id = log.start_session(config, model="tiny")
    for record in records:
        log.record_step(record)
    log.close()
    return load_session(open_database(folder / "log.db"), session_id).steps


def make_sequence(token_ids: list[int]) -> Sequence:
    """A one-sequence request outside any engine, for driving a KVCacheManager directly."""
    request = Request(f"r{next(_sequence_ids)}", None, list(token_ids), SamplingParams())
    seq = Sequence(request.request_id, request, 0, list(token_ids), len(token_ids))
    request.sequences.append(seq)
    return seq


@dataclass
class EngineRun:
    outputs: list[RequestOutput]  # in the order the prompts were given
    records: list[StepRecord]


def run_to_completion(engine: EngineCore, prompts, params: SamplingParams | list) -> EngineRun:
    """Queue every prompt, step until all finish, return final outputs in prompt order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts, params)]
    finished: dict[str, RequestOutput] = {}
    records = []
    for _ in range(100_000):
        if not engine.has_unfinished_requests():
            break
        result = engine.step()
        records.append(result.record)
        finished.update((o.request_id, o) for o in result.outputs if o.finished)
    else:
        pytest.fail("engine did not finish its requests")
    return EngineRun([finished[i] for i in ids], records)


@pytest.fixture(scope="session")
def run_engine() -> Callable[..., EngineRun]:
    """run_engine(engine, prompts, params) -> EngineRun (see run_to_completion)."""
    return run_to_completion


@pytest.fixture(scope="session")
def tiny_llama_path(tiny_chat_model_path) -> Path:
    """The same tiny chat Llama under the name the serving tests (and others) ask for."""
    return tiny_chat_model_path


@pytest.fixture(scope="module")
def all_cpu_threads():
    """For a module testing a real-sized model: lift the one-thread pin while it runs."""
    previous = torch.get_num_threads()
    torch.set_num_threads(DEFAULT_NUM_THREADS)
    yield
    torch.set_num_threads(previous)


def plotly_array(value) -> np.ndarray:
    """A data array of a figure's JSON: a plain list, or plotly's typed-array spec
    ({"dtype", "bdata", "shape"}) as numpy arrays are sent."""
    if not isinstance(value, dict):
        return np.array(value, dtype=object)
    array = np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
    shape = value.get("shape")
    if shape is not None:
        array = array.reshape([int(n) for n in str(shape).split(",")])
    return array


def heatmap_state_codes(figure: dict) -> np.ndarray:
    """Per-cell state codes (0 free .. 3 shared, NaN for no block) of a state heatmap's two
    traces, as ui.figures draws them: unshared codes, and shared cells' ref counts."""
    unshared = plotly_array(figure["data"][0]["z"]).astype(np.float32)
    shared = plotly_array(figure["data"][1]["z"]).astype(np.float32)
    return np.where(np.isnan(unshared), np.where(np.isnan(shared), np.nan, 3), unshared)


def save_tiny_byte_level_model(folder: Path) -> Path:
    """A 2-layer random Llama with a byte-level BPE tokenizer (GPT-2's 256-symbol alphabet,
    no merges): any text encodes, and grammar engines (llguidance) can read its vocabulary."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab=_chat_vocab(alphabet), merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return _save_chat_llama(folder, core, additional_special_tokens=CHAT_SPECIALS[1:])


@pytest.fixture(scope="session")
def tiny_byte_level_model_path(tmp_path_factory) -> Path:
    return save_tiny_byte_level_model(tmp_path_factory.mktemp("tiny-byte-llama"))


def transformers_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, exactly max_tokens long: the parity
    oracle (min_new_tokens keeps an EOS from ending it early)."""
    with torch.inference_mode():
        return [model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                               min_new_tokens=max_tokens, do_sample=False)[0, len(prompt):].tolist()
                for prompt in prompts]


def greedy_expectations(tiny_model, prompts: list[list[int]],
                        max_tokens: int) -> Callable[[str], list[list[int]]]:
    """expected(arch): transformers' greedy continuation of every prompt, computed once per
    architecture (the parity tests' oracle, for a module-scoped fixture)."""
    cache: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            cache[arch] = transformers_greedy(tiny_model(arch).hf_model, prompts, max_tokens)
        return cache[arch]

    return get


def first_token_ids(run: EngineRun) -> list[list[int]]:
    """Each request's first completion's tokens, in request order."""
    return [output.outputs[0].token_ids for output in run.outputs]


def wait_until(condition: Callable[[], object], timeout: float = 10.0,
               what: str = "the condition") -> None:
    """Return as soon as condition() is true; fail if it is still false after `timeout`
    seconds. For state another thread or process changes, with no event to wait on."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def free_port() -> int:
    """A loopback port free right now (for servers that take a port, not a socket)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# Debian's Chromium, driven by Playwright (browser downloads are blocked here).
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for a module's browser tests (each opens its own pages)."""
    if not CHROMIUM.exists():
        pytest.skip("Debian chromium is not installed")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@contextmanager
def dashboard_served(engine, db_path: Path):
    """The dashboard on a started engine as app.py serves it: a session log at `db_path`,
    its recorder and the page on a free loopback port; yields (log, url)."""
    # Here, not at the top: most test modules never load Gradio.
    from kvscope.storage import SessionLog, record_sessions
    from kvscope.ui import build_ui, page_options

    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    log = SessionLog(db_path)
    log.start_session(engine.config.to_dict(), engine.model_path)
    recorder = record_sessions(engine, log)
    blocks = build_ui(engine, log)
    port = free_port()
    blocks.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True,
                  quiet=True, **page_options())
    try:
        yield log, f"http://127.0.0.1:{port}/"
    finally:
        blocks.close()
        recorder.stop()
        log.close()


def serve(app, **uvicorn_options) -> tuple[str, uvicorn.Server, threading.Thread]:
    """Run `app` on a free loopback port in a background thread (stop: `should_exit`)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, **{"log_level": "warning", **uvicorn_options}))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout=30, what="the server to start")
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def noisy_output_copy(model: PreTrainedModel, std: float, seed: int) -> PreTrainedModel:
    """`model` with Gaussian noise of `std` on its output projection: a draft model for
    speculative decoding that agrees with it on some tokens and not on others."""
    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    torch.manual_seed(seed)
    with torch.no_grad():
        copy.lm_head.weight.add_(torch.randn_like(copy.lm_head.weight) * std)
    return copy.eval()
