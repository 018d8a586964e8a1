"""The knobs panel's handler: Apply -> AsyncEngine.reconfigure, or the refusal shown."""

import gradio as gr

BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
PREEMPTION_MODES = ["recompute", "swap"]


def current_knobs(engine) -> tuple:
    """The knob widgets' values for the engine's config, in apply_knobs' order."""
    config = engine.config
    return (config.block_size, config.gpu_memory_utilization, config.device_memory_gb,
            config.max_num_batched_tokens, config.enable_prefix_caching,
            config.enable_chunked_prefill, config.preemption_mode)


def pool_markdown(plan) -> str:
    return (f"**Pool:** {plan.num_blocks} blocks x {plan.block_size} tokens = "
            f"{plan.num_tokens} tokens ({plan.kv_cache_bytes / 2**20:.1f} MiB) · "
            f"**max concurrency** {plan.max_concurrency:.2f} x {plan.max_model_len} tokens")


def apply_knobs(engine, feed, session_log, block_size, gpu_memory_utilization,
                device_memory_gb, max_num_batched_tokens, enable_prefix_caching,
                enable_chunked_prefill, preemption_mode, abort_running) -> str:
    """Rebuild the KV cache; a refused knob leaves the engine as it was and says why."""
    try:
        plan = engine.reconfigure(
            abort_running=bool(abort_running), block_size=int(block_size),
            gpu_memory_utilization=float(gpu_memory_utilization),
            device_memory_gb=float(device_memory_gb),
            max_num_batched_tokens=int(max_num_batched_tokens) if max_num_batched_tokens
            else None,
            enable_prefix_caching=bool(enable_prefix_caching),
            enable_chunked_prefill=bool(enable_chunked_prefill),
            preemption_mode=str(preemption_mode))
    except (ValueError, TypeError) as error:
        gr.Warning(f"Not applied: {error}")
        return f"**Not applied** (the engine is unchanged): {error}"
    feed.clear()
    if session_log is not None:
        session_log.record_config(engine.config.to_dict())
    return "Applied. " + pool_markdown(plan)
