"""kvscope's engine, by stage in the order a request meets them:

  core/       the request, the scheduler, the KV-cache manager and its block pool, beam
              search, EngineCore.step() that runs one step of them all, and the typed
              events they emit (kv_events)
  worker/     the model runner, the models, the weight loaders and the memory plan
  sample/     sampling params, logit edits, structured outputs and the sampler
  telemetry/  beside the core, from its events: records, pool deltas, the pool's mirror
  frontend/   the engine thread and the streams that carry outputs to callers
  serving/    the OpenAI-compatible HTTP edge
  replicas/   engine replicas on Ray behind a KV-aware router

Its top level holds the public entry points: LLM (llm.py), EngineConfig (config.py), the
outputs (outputs.py) and EngineView, the interface the front ends read (view.py).
"""

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.beam_search import BeamSearchParams
from kvscope.engine.llm import LLM
from kvscope.engine.outputs import CompletionOutput, RequestOutput
from kvscope.engine.sample.sampling_params import SamplingParams

__all__ = ["LLM", "BeamSearchParams", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]
