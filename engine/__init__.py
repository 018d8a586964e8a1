"""kvscope's engine: paged KV cache, continuous batching and the offline LLM API."""

import os
import sys
import warnings

# libgomp (torch's OpenMP) reads its wait policy once, when torch loads it. By default its
# workers spin for a while after every parallel region, and on a machine with few cores
# they take the core that the C++ kernels' own work pool (kernels/csrc/work_pool.cpp) needs
# next: on 2 cores a single stream decoded 65-69 tok/s with spinning workers and 93-111
# with passive ones. So kvscope asks for passive workers, unless the user chose a policy.
if "OMP_WAIT_POLICY" not in os.environ:
    if "torch" in sys.modules:
        warnings.warn("torch was imported before kvscope's engine, so its OpenMP workers spin "
                      "between parallel regions and slow the CPU kernels; import engine first "
                      "or set OMP_WAIT_POLICY=PASSIVE", stacklevel=2)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

from engine.beam_search import BeamSearchParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "BeamSearchParams", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]
