"""From logits to tokens: sampling params, the logit edits before sampling (penalties, bias,
structured-output masks) and the sampler."""
