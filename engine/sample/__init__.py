"""From logits to tokens: the logit edits before sampling (penalties, bias, structured-output
masks), speculative verification and the sampler. The params they read are the engine's
shared vocabulary (engine/sampling_params.py)."""
