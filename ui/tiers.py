"""The pool and the disk tier side by side, from the engine's own counters (Engine & load
tab), and a logged session's tier from its steps (Sessions tab).

Hit rates are in prompt tokens, as vLLM counts them: the pool's over every prompt token
asked of the prefix cache, the tier's over the tokens the pool lacked. Bytes moved are
since the previous refresh (the first refresh: since the engine started).
"""

from kvscope.engine.core.kv_offload.tier import DISK_TO_POOL, POOL_TO_DISK
from kvscope.engine.entrypoints.view import EngineView
from kvscope.engine.telemetry.records import TIER_STEP_FIELDS, StepRecord

MiB = 1 << 20
OFF = ("**Disk tier:** off. Turn it on with a directory and a size below (kv_offload_dir, "
       "kv_offload_gb), or start with `--kv-offload-dir PATH --kv-offload-gb N`: blocks the "
       "prefix cache evicts are written there and loaded back on a prefix hit.")


def size(num_bytes: int) -> str:
    """MiB, or KiB below one MiB (a tiny model's blocks)."""
    return (f"{num_bytes / MiB:.1f} MiB" if num_bytes >= MiB else
            f"{num_bytes / 1024:.1f} KiB")


def _rate(hits: int, queries: int) -> str:
    return f"{hits / queries:.1%} ({hits}/{queries} tokens)" if queries else "no queries yet"


def tiers_markdown(engine: EngineView, before=None) -> tuple[str, object]:
    """The tiers' table, and the counters it read (pass them back as `before` next time)."""
    counters = engine.counters()
    if engine.config.kv_offload_dir is None:
        return OFF, counters
    plan = engine.memory_plan
    moved = {kind: counters.kv_offload_bytes.get(kind, 0)
             - (before.kv_offload_bytes.get(kind, 0) if before is not None else 0)
             for kind in (POOL_TO_DISK, DISK_TO_POOL)}
    loads = counters.kv_offload_loads
    latency = (f"{counters.kv_offload_seconds.get(DISK_TO_POOL, 0.0) / loads * 1e3:.1f} ms "
               f"mean over {loads} loads" if loads else "no loads yet")
    tier_rate = _rate(counters.external_prefix_cache_hits,
                      counters.external_prefix_cache_queries)
    rows = [
        "| | pool | disk tier |",
        "|---|---|---|",
        f"| blocks held | {plan.num_blocks} | {counters.kv_tier_blocks} |",
        f"| bytes held (of size) | {size(plan.kv_cache_bytes)} | "
        f"{size(counters.kv_tier_bytes)} of {size(counters.kv_tier_capacity_bytes)} |",
        f"| hit rate | {_rate(counters.prefix_cache_hits, counters.prefix_cache_queries)} | "
        f"{tier_rate} |",
        f"| bytes moved since last refresh | {size(moved[POOL_TO_DISK])} out to the tier | "
        f"{size(moved[DISK_TO_POOL])} into the pool |",
        f"| load latency | | {latency} |",
    ]
    return (f"**Disk tier** at `{engine.config.kv_offload_dir}`:\n\n" + "\n".join(rows),
            counters)


def session_tier_markdown(steps: list[StepRecord]) -> str:
    """A logged session's disk tier in one line: hit rate, what it stored, loaded and
    dropped, and what it held at its last step; empty for a session that ran without
    one."""
    tiered = [dict(zip(TIER_STEP_FIELDS, step.kv_tier, strict=True))
              for step in steps if step.kv_tier]
    if not tiered:
        return ""
    total = {name: sum(step[name] for step in tiered) for name in TIER_STEP_FIELDS}
    last = tiered[-1]
    return (f"**Disk tier** hit rate {_rate(total['hit_tokens'], total['query_tokens'])} · "
            f"{total['loads']} loads ({total['blocks_loaded']} blocks, "
            f"{size(total['bytes_loaded'])}) · {total['blocks_stored']} blocks stored, "
            f"{total['blocks_removed']} removed · held at the last step: "
            f"{last['blocks_held']} blocks ({size(last['bytes_held'])})")
