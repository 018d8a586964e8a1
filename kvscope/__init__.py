"""kvscope: a paged-KV LLM inference engine you can watch while it serves.

The public API is vLLM's offline one: `from kvscope import LLM, SamplingParams`.
The folders at the repository's top are installed as this package's parts:

  kvscope.engine   everything that decides and computes (engine/)
  kvscope.kernels  the attention and forward ops, C++ and Triton (kernels/)
  kvscope.ui       the Gradio dashboard (ui/)
  kvscope.storage  the SQLite session log (storage/)
"""

import importlib
import importlib.machinery
import os
import sys
import warnings

# libgomp (torch's OpenMP) reads its wait policy once, when torch loads it. By default its
# workers spin for a while after every parallel region, and on a machine with few cores
# they take the core that the C++ kernels' own work pool (kernels/csrc/work_pool.cpp) needs
# next. So kvscope asks for passive workers, unless the user chose a policy.
if "OMP_WAIT_POLICY" not in os.environ:
    if "torch" in sys.modules:
        warnings.warn("torch was imported before kvscope, so its OpenMP workers spin between "
                      "parallel regions and slow the CPU kernels; import kvscope first or set "
                      "OMP_WAIT_POLICY=PASSIVE", stacklevel=2)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

__version__ = "0.1.0"

# The parts keep their folders at the repository's top (engine/, kernels/, ui/, storage/).
# Where the repository itself is on sys.path (`python app.py`, `python -m pytest` or
# `python -c` run from it), those folders would also import as top-level packages and hide
# installed ones of the same name: above all Hugging Face's `kernels`, which transformers
# imports when it is installed. This finder, first on the meta path, looks such a name up on
# sys.path without the repository, so the installed package wins wherever there is one.
_REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PARTS = ("engine", "kernels", "ui", "storage")


class _InstalledBeforeParts:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if path is not None or name not in _PARTS:
            return None
        elsewhere = [entry for entry in sys.path
                     if os.path.abspath(entry or os.curdir) != _REPOSITORY]
        return importlib.machinery.PathFinder.find_spec(name, elsewhere, target)


sys.meta_path.insert(0, _InstalledBeforeParts())

# The public names load the engine (torch, transformers) on first use, so that a part such
# as kvscope.storage or the kernel build (`python -m kvscope.kernels.cpu_extension`) does
# not pay for it.
_PUBLIC = {
    "LLM": "kvscope.engine.entrypoints.llm",
    "EngineConfig": "kvscope.engine.config",
    "SamplingParams": "kvscope.engine.sampling_params",
    "BeamSearchParams": "kvscope.engine.orchestrator.beam_search",
    "RequestOutput": "kvscope.engine.outputs",
    "CompletionOutput": "kvscope.engine.outputs",
}
__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'kvscope' has no attribute {name!r}")
