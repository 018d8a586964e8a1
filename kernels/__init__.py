"""Paged-attention and KV-store ops over block tables, shared by every model.

CUDA tensors run the Triton kernels, CPU tensors the plain-torch twins in
kernels/reference.py. KVSCOPE_ATTENTION_BACKEND=triton|torch forces one; Triton on CPU
tensors needs TRITON_INTERPRET=1, set before anything imports triton (transformers does).
Triton is imported lazily, so the torch path works without it installed.

`kernels.paged_attention` is always the op above, even after the Triton submodule of the
same name is loaded; reach the submodule with `from kernels.paged_attention import ...`.
"""

import functools
import importlib
import importlib.util
import os
import sys
import types

import torch

from kernels import reference

__all__ = ["attention_backend_name", "paged_attention", "store_kv", "triton_available"]

BACKEND_ENV = "KVSCOPE_ATTENTION_BACKEND"
BACKENDS = ("triton", "torch")
_TRITON_MODULE_NAMES = ("kernels.paged_attention", "kernels.kv_store")


@functools.cache
def triton_available() -> bool:
    """Whether the triton package is installed (without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _triton_interpreted() -> bool:
    """Whether the Triton kernels run (or, once imported, will run) in the interpreter."""
    imported = [sys.modules[name] for name in _TRITON_MODULE_NAMES if name in sys.modules]
    if imported:
        return all(module.INTERPRETED for module in imported)
    return _interpreter_requested()


def attention_backend_name(device: torch.device | str) -> str:
    """'triton' or 'torch': the backend the ops use for tensors on this device.

    Raises ValueError for a bad KVSCOPE_ATTENTION_BACKEND or a forced Triton backend that
    cannot run here, so an engine that calls this at startup fails fast.
    """
    device = torch.device(device)
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced and forced not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={forced!r} must be one of {', '.join(BACKENDS)}")
    if forced == "torch":
        return "torch"
    if forced == "triton":
        if not triton_available():
            raise ValueError(f"{BACKEND_ENV}=triton needs the triton package; it is not installed")
        if device.type != "cuda" and not _triton_interpreted():
            raise ValueError(
                f"{BACKEND_ENV}=triton on device {device.type!r} needs TRITON_INTERPRET=1 "
                "(set before anything imports triton); Triton compiles for CUDA devices only")
        return "triton"
    return "triton" if device.type == "cuda" and triton_available() else "torch"


def _triton_module(name: str) -> types.ModuleType:
    module = sys.modules.get(name)
    return module if module is not None else importlib.import_module(name)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged K/V.

    query [num_tokens, num_heads, head_dim]; key_cache / value_cache [num_blocks,
    block_size, num_kv_heads, head_dim]; block_tables [num_seqs, max_blocks] int32;
    seq_lens [num_seqs] int32 (KV length including the new tokens); query_start_loc
    [num_seqs + 1] int32. The new tokens of sequence i are its last q_len_i positions.
    """
    if attention_backend_name(query.device) == "triton":
        implementation = _triton_module("kernels.paged_attention").paged_attention
    else:
        implementation = reference.paged_attention
    return implementation(query, key_cache, value_cache, block_tables, seq_lens,
                          query_start_loc, scale, out)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [num_tokens, kv_heads, head_dim] into their slots; -1 is skipped."""
    if attention_backend_name(key.device) == "triton":
        implementation = _triton_module("kernels.kv_store").store_kv
    else:
        implementation = reference.store_kv
    implementation(key, value, key_cache, value_cache, slot_mapping)


class _KernelsPackage(types.ModuleType):
    def __setattr__(self, name: str, value: object) -> None:
        # Loading the submodule kernels.paged_attention binds it as an attribute of this
        # package, which would shadow the op of the same name that every model calls.
        if name == "paged_attention" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _KernelsPackage
