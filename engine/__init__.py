"""kvscope's engine, by stage from the bottom up; a stage imports only the stages below it
(tests/test_layering.py keeps that order):

  config.py, speculative_config.py, sampling_params.py, outputs.py
              the vocabulary every stage shares: the knobs, the sampling params, the outputs
  core/       what decides: the request, the scheduler, the KV-cache manager and its block
              pool, and the typed events they emit (kv_events)
  worker/     what computes: the model runner, the models, the weight loaders, the memory plan
  sample/     from logits to tokens: logit edits, structured outputs, the sampler
  spec_decode/ speculative decoding: proposers, the draft model, acceptance statistics
  telemetry/  what a step leaves for readers: records, pool deltas, the pool's mirror
  orchestrator/ what runs the stages: EngineCore.step(), beam search, detokenizing, and the
              engine thread with the streams that carry outputs to callers
  replicas/   engine replicas on Ray behind a KV-aware router
  entrypoints/ what callers hold: LLM (offline), EngineView (the served engine's interface),
              chat templates
  serving/    the OpenAI-compatible HTTP edge
  replay/     `kvscope replay`: a session or a trace run again under other knobs

The public names (LLM, SamplingParams, ...) are kvscope's own: `from kvscope import LLM`.
"""
