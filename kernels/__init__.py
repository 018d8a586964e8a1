"""The kernels every model calls, one record of them per backend (kernels/kernel_ops.py).

Three backends implement KernelOps (the contracts are kernels/reference.py's and
kernels/kernel_ops.py's):

  triton  kernels/triton_attention.py and triton_kv_store.py for attention,
          triton_recurrent.py for the recurrent layers' decode steps, the torch twins
          for the rest: CUDA tensors (CPU tensors only in the Triton interpreter,
          TRITON_INTERPRET=1 set before triton is imported)
  cpu     C++ kernels (kernels/csrc) compiled on first use for this CPU:
          kernels/cpu_kernels.py, the only module that reaches torch.ops.kvscope
  torch   the plain-torch twins (kernels/torch_ops.py, kernels/reference.py): the fallback
          and the tests' oracle

`select_ops(device)` picks one, once: the model runner calls it at start-up and hands the
record to the model's modules, the decoder stack and the sampler.
KVSCOPE_ATTENTION_BACKEND=triton|cpu|torch forces a backend; otherwise CUDA gets triton and
the CPU gets cpu (torch if it cannot be built, with a warning; KVSCOPE_REQUIRE_CPU_KERNELS=1
makes that an error instead, so that a test run cannot pass on the fallback alone).
"""

import functools
import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import replace

import torch

from kvscope.kernels.kernel_ops import (
    EXPERT_ACTIVATIONS,
    ExpertWeights,
    KernelOps,
    PackedLinearKernels,
    PrepackedWeight,
)
from kvscope.kernels.torch_ops import TORCH_OPS

__all__ = ["BACKENDS", "BACKEND_ENV", "EXPERT_ACTIVATIONS", "REQUIRE_CPU_KERNELS_ENV", "TORCH_OPS",
           "ExpertWeights", "KernelOps", "PackedLinearKernels", "PrepackedWeight", "backend_name",
           "cpu_kernels_required", "select_ops", "triton_available"]

logger = logging.getLogger(__name__)
BACKEND_ENV = "KVSCOPE_ATTENTION_BACKEND"
BACKENDS = ("triton", "cpu", "torch")
REQUIRE_CPU_KERNELS_ENV = "KVSCOPE_REQUIRE_CPU_KERNELS"
_TRITON_MODULE_NAMES = ("kvscope.kernels.triton_attention", "kvscope.kernels.triton_kv_store",
                        "kvscope.kernels.triton_recurrent")


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


def cpu_kernels_required() -> bool:
    """Whether KVSCOPE_REQUIRE_CPU_KERNELS is set (1, true, on, yes): a C++ build that fails
    is then an error, not a fall back to the torch path (`make test` and CI set it)."""
    return os.environ.get(REQUIRE_CPU_KERNELS_ENV, "").strip().lower() in ("1", "true", "on", "yes")


def _cpu_kernels_build() -> bool:
    """Whether the C++ CPU kernels are (or can now be) built and loaded.

    Raises RuntimeError, with the build's own error (the compiler's output), where they
    cannot be and cpu_kernels_required()."""
    from kvscope.kernels import cpu_kernels

    try:
        cpu_kernels.load()
    except Exception as error:  # noqa: BLE001 (any build failure means: use the fallback)
        if cpu_kernels_required():
            raise RuntimeError(f"{REQUIRE_CPU_KERNELS_ENV} is set and the C++ CPU kernels "
                               f"could not be built: {error}") from error
        logger.warning("C++ CPU kernels unavailable (%s); using the torch path",
                       error)
        return False
    return True


def backend_name(device: torch.device | str) -> str:
    """'triton', 'cpu' or 'torch': the backend select_ops gives for this device.

    Raises ValueError for a bad KVSCOPE_ATTENTION_BACKEND or a forced backend that
    cannot run here, so an engine that calls this at start-up fails fast. Choosing the
    cpu backend builds the C++ kernels (once per CPU and source; cached).
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
    if forced == "cpu":
        if device.type != "cpu":
            raise ValueError(f"{BACKEND_ENV}=cpu runs on CPU tensors only, not {device.type!r}")
        if not _cpu_kernels_build():
            raise ValueError(f"{BACKEND_ENV}=cpu: the C++ kernels could not be built here "
                             "(see the log); unset it to fall back to the torch path")
        return "cpu"
    if device.type == "cuda":
        return "triton" if triton_available() else "torch"
    return "cpu" if device.type == "cpu" and _cpu_kernels_build() else "torch"


def select_ops(device: torch.device | str) -> KernelOps:
    """The kernels for tensors on this device (see backend_name for the choice)."""
    name = backend_name(device)
    if name == "triton":
        attention = importlib.import_module("kvscope.kernels.triton_attention")
        store = importlib.import_module("kvscope.kernels.triton_kv_store")
        recurrent = importlib.import_module("kvscope.kernels.triton_recurrent")
        return replace(TORCH_OPS, backend=name, paged_attention=attention.paged_attention,
                       store_kv=store.store_kv, recurrent=recurrent.RECURRENT)
    if name == "cpu":
        from kvscope.kernels import cpu_kernels

        return cpu_kernels.kernel_ops()
    return TORCH_OPS
