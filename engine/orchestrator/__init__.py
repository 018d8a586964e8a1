"""What runs the stages below it: EngineCore.step() (schedule -> run -> sample -> update ->
outputs), beam search above the scheduler, incremental detokenizing and chat templates; and
the engine thread (AsyncEngine) with the streams and channels that carry its outputs to
callers. Nothing below imports this folder (vLLM v1 keeps v1/engine/ above v1/core/ alike)."""
