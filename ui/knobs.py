"""The knobs panel's handler: Apply -> AsyncEngine.reconfigure, or the refusal shown."""

import os
import shutil
from pathlib import Path

import gradio as gr

from kvscope.engine.entrypoints.view import EngineView
from kvscope.engine.worker.memory import GiB, MemoryPlan, PoolTooSmall, plan_blocks
from kvscope.ui.form_values import form_number

# The form's knobs, in the order of its widgets and of apply_knobs' arguments.
KNOBS = ("block_size", "gpu_memory_utilization", "device_memory_gb", "max_num_batched_tokens",
         "enable_prefix_caching", "enable_chunked_prefill", "preemption_mode", "kv_cache_dtype",
         "kv_offload_dir", "kv_offload_gb")


def current_knobs(engine: EngineView) -> tuple:
    """The knob widgets' values for the engine's live config, in KNOBS order."""
    config = engine.config
    return tuple(getattr(config, name) for name in KNOBS)


def live_form(engine: EngineView) -> tuple:
    """What a newly opened (or reloaded) tab shows: the live knobs and the live pool, so
    Apply there never reverts a reconfigure made from another tab."""
    return (*current_knobs(engine), pool_markdown(engine.memory_plan, engine.config))


def pool_markdown(plan, config) -> str:
    """The pool, and the weights it was sized around (their quantization sets their bytes)."""
    by_type = plan.weights_by_type()
    by_type = f": {by_type}" if by_type else ""
    return (f"**Weights:** {plan.weight_bytes / 2**20:.1f} MiB (quantization "
            f"{config.quantization}{by_type}) · "
            f"**Pool:** {plan.num_blocks} blocks x {plan.block_size} tokens = "
            f"{plan.num_tokens} tokens ({plan.kv_cache_bytes / 2**20:.1f} MiB; "
            f"{plan.describe_kv_dtype()}) · "
            f"**max concurrency** {plan.max_concurrency:.2f} x {plan.max_model_len} tokens"
            + _state_slots(plan))


def _state_slots(plan) -> str:
    """A model with recurrent layers: its state slots, and what the same sequences would
    take with every layer full attention ("" without recurrent layers)."""
    if not plan.bytes_per_state_slot:
        return ""
    return (f" · **State slots:** {plan.num_state_slots} x {plan.bytes_per_state_slot} bytes "
            f"({plan.state_slot_bytes / 2**20:.1f} MiB; a slot is "
            f"{plan.bytes_per_state_slot / plan.bytes_per_block:.2f} blocks' bytes) · "
            f"**Full attention:** {plan.describe_full_attention()}")


def _pending(values: tuple) -> dict:
    """Widget values -> knobs. An emptied token budget means "derive it"; 0 stays 0, for
    the engine to refuse with its limit."""
    (block_size, utilization, memory_gb, budget, prefix, chunked, preemption, kv_dtype,
     offload_dir, offload_gb) = values
    return {"block_size": form_number("block_size", block_size, integer=True),
            "gpu_memory_utilization": form_number("gpu_memory_utilization", utilization),
            "device_memory_gb": form_number("device_memory_gb", memory_gb),
            "max_num_batched_tokens": None if budget in (None, "") else form_number(
                "max_num_batched_tokens", budget, integer=True),
            "enable_prefix_caching": bool(prefix), "enable_chunked_prefill": bool(chunked),
            "preemption_mode": str(preemption), "kv_cache_dtype": str(kv_dtype),
            # An emptied directory turns the disk tier off.
            "kv_offload_dir": offload_dir.strip() if offload_dir and offload_dir.strip()
            else None,
            "kv_offload_gb": form_number("kv_offload_gb", offload_gb)}


def _changes(config, pending: dict) -> str:
    changed = [f"{name} {getattr(config, name)} → {value}" for name, value in pending.items()
               if value is not None and value != getattr(config, name)]
    return "Changed in this form: " + ("; ".join(changed) if changed else "nothing") + "."


def _too_small(error: PoolTooSmall) -> str:
    """The pool refusal in the form's own terms: only knobs this form has."""
    plan = error.plan
    return (f"the pool would hold {plan.num_tokens} tokens ({plan.num_blocks} blocks of "
            f"{plan.block_size}: {plan.device_memory_bytes / GiB:.2f} GiB x "
            f"gpu_memory_utilization {plan.gpu_memory_utilization} − weights "
            f"{plan.weight_bytes / GiB:.3f} GiB − activations "
            f"{plan.peak_activation_bytes / GiB:.3f} GiB), but one sequence of up to "
            f"{plan.max_model_len} tokens must fit: raise gpu_memory_utilization or "
            "device_memory_gb, or lower max_num_batched_tokens (a smaller step needs less "
            "activation memory)")


def host_memory_bytes() -> int:
    """The machine's physical RAM (where a CPU engine's pool and weights live)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_device_memory(engine: EngineView, memory_gb: float) -> None:
    """A CPU pool larger than the RAM is refused before a rebuild tries (and fails deep
    inside an allocation)."""
    if engine.resolved_identity()["device"] == "cpu" and memory_gb * GiB > host_memory_bytes():
        raise ValueError(f"device_memory_gb={memory_gb:g} is more than this machine's RAM "
                         f"({host_memory_bytes() / GiB:.1f} GiB): choose at most "
                         f"{host_memory_bytes() / GiB:.1f}")


def check_offload_disk(engine: EngineView, folder: str | None, size_gb: float) -> None:
    """A disk tier where no file can be written, or larger than the free disk there, is
    refused (the engine would otherwise start without it, or capped, with only a log
    warning). From the page, the folder must be an existing absolute path: a typo or a
    relative name would otherwise create folders wherever the server happens to run."""
    if folder is None:
        return
    existing = Path(folder).expanduser()
    if not existing.is_absolute() or not existing.is_dir():
        raise ValueError(f"kv_offload_dir={folder!r} is not an existing directory given by "
                         "its absolute path: create the folder first and give its full path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"kv_offload_dir={folder!r} is not a writable directory: choose a "
                         "folder this process can write")
    held = engine.counters().kv_tier_bytes if engine.config.kv_offload_dir == folder else 0
    available = shutil.disk_usage(existing).free + held
    if size_gb * GiB > available:
        raise ValueError(f"kv_offload_gb={size_gb:g} is larger than the free disk at "
                         f"{existing} ({available / GiB:.2f} GiB with what the tier holds): "
                         f"choose at most {available / GiB:.2f}")


def check_machine(engine: EngineView, pending: dict) -> None:
    """Refuse, in the knob's own terms, what this machine cannot hold before a rebuild
    tries: a CPU pool larger than the RAM, a disk tier that cannot be written or is larger
    than the free disk, and a token budget whose profiling step alone needs more memory
    than the pool may use."""
    on_cpu = engine.resolved_identity()["device"] == "cpu"
    memory_gb = pending["device_memory_gb"]
    check_device_memory(engine, memory_gb)
    check_offload_disk(engine, pending["kv_offload_dir"], pending["kv_offload_gb"])
    budget = pending["max_num_batched_tokens"]
    if budget is None:
        return
    plan = engine.memory_plan
    # The profiling step computes `budget` tokens at once and holds their K/V: a floor
    # on what a step of that size needs, whatever its activations add.
    kv_bytes_per_token = plan.bytes_per_block / plan.block_size
    memory = (memory_gb * GiB if on_cpu else plan.device_memory_bytes) * pending[
        "gpu_memory_utilization"]
    if budget * kv_bytes_per_token > memory:
        raise ValueError(
            f"max_num_batched_tokens={budget} is more than one step can hold here: the K/V "
            f"of {budget} tokens alone is {budget * kv_bytes_per_token / GiB:.3g} GiB, over "
            f"the {memory / GiB:.3g} GiB that device_memory_gb x gpu_memory_utilization "
            f"allow; at most {int(memory // kv_bytes_per_token)} tokens fit")


def apply_knobs(engine: EngineView, feed, *values) -> str:
    """Rebuild the KV cache; a refused knob leaves the engine as it was and says why,
    next to the live and the asked-for values. The last value is "abort running"."""
    *knob_values, abort_running = values
    config = engine.config
    try:
        pending = _pending(tuple(knob_values))
    except ValueError as error:  # a widget left empty or holding text
        return _refused(f"{error}")
    try:
        # The engine's own limits first: check_machine's arithmetic assumes them.
        engine.config.with_changes(**pending)
        check_machine(engine, pending)
        plan = engine.reconfigure(abort_running=bool(abort_running), **pending)
    except PoolTooSmall as error:
        return _refused(f"{_too_small(error)}. {_changes(config, pending)}")
    except (ValueError, TypeError) as error:
        return _refused(f"{error}. {_changes(config, pending)}")
    feed.clear()  # the session log gets the new config from storage.record_sessions
    return "Applied. " + pool_markdown(plan, engine.config)


def _refused(message: str) -> str:
    gr.Warning(f"Not applied: {message}")
    return f"**Not applied** (the engine is unchanged): {message}"


# ---- the what-if preview -------------------------------------------------------------------
def planned_pool(engine: EngineView, block_size: int, utilization: float,
                 memory_gb: float) -> MemoryPlan:
    """The pool a rebuild with these knobs would make (the same arithmetic as the engine's,
    with the activations measured for the live token budget); PoolTooSmall if it would be
    refused."""
    plan, config = engine.memory_plan, engine.config
    on_cpu = engine.resolved_identity()["device"] == "cpu"
    # K and V of one token in a block's layers (all of them, for one KV cache group)
    per_token = plan.bytes_per_block // plan.block_size
    return plan_blocks(int(memory_gb * GiB) if on_cpu else plan.device_memory_bytes,
                       utilization, plan.weight_bytes, plan.peak_activation_bytes,
                       per_token * block_size, block_size, plan.max_model_len,
                       config.num_gpu_blocks_override, plan.groups,
                       bytes_per_state_slot=plan.bytes_per_state_slot,
                       max_num_seqs=plan.max_num_seqs)


def fragmentation(token_counts: list[int], block_size: int) -> tuple[int, int]:
    """(blocks, empty slots in last blocks) that sequences of these lengths hold."""
    blocks = sum(-(-tokens // block_size) for tokens in token_counts)
    return blocks, blocks * block_size - sum(token_counts)


def what_if_markdown(engine: EngineView, token_counts: list[int], block_size, utilization,
                     memory_gb) -> str:
    """Before Apply: the pool these knobs would build and what the live sequences
    (`token_counts`, their lengths) would hold in it, next to now."""
    try:
        block_size = form_number("block_size", block_size, integer=True)
        utilization = form_number("gpu_memory_utilization", utilization)
        memory_gb = form_number("device_memory_gb", memory_gb)
        # The engine's own limits (block_size a power of two, utilization in (0, 1]), as
        # Apply would meet them: the arithmetic below assumes them.
        engine.config.with_changes(block_size=block_size, gpu_memory_utilization=utilization,
                                   device_memory_gb=memory_gb)
        check_device_memory(engine, memory_gb)
        plan = planned_pool(engine, block_size, utilization, memory_gb)
    except PoolTooSmall as error:
        return f"**What if:** Apply would be refused: {_too_small(error)}."
    except ValueError as error:
        return f"**What if:** Apply would be refused: {error}."
    now = engine.memory_plan
    lines = [f"**What if** block_size {block_size}, gpu_memory_utilization {utilization:g}"
             f", device_memory_gb {memory_gb:g}: the pool would hold {plan.num_blocks} "
             f"blocks x {block_size} = {plan.num_tokens} token slots (now {now.num_blocks} x "
             f"{now.block_size} = {now.num_tokens})."]
    if not token_counts:
        lines.append("No live sequences now: send some load to see their blocks and waste.")
        return "  \n".join(lines)
    one = len(token_counts) == 1
    live = "The one live sequence" if one else f"The {len(token_counts)} live sequences"
    for label, size in (("would hold", block_size), ("holds now" if one else "hold now",
                                                      now.block_size)):
        blocks, waste = fragmentation(token_counts, size)
        lines.append(f"{live} {label} {blocks} blocks; "
                     f"the empty slots of their last blocks (internal fragmentation) are "
                     f"{waste} tokens, {waste / (blocks * size):.1%} of those blocks.")
    return "  \n".join(lines)
