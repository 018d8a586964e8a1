"""Keeps Python's cyclic garbage collector off the engine's long-lived objects.

A generation-2 collection walks every object the collector tracks, on whichever thread
happens to allocate when the threshold is crossed, holding the GIL throughout. A pool of
N blocks is N KVBlock objects, on top of the model, torch and the web stack: such a
collection took hundreds of milliseconds at 100k blocks and paused the engine's step in the
middle of its telemetry (bench/dashboard_scale.py; docs/performance-history.md, 'Figures the
code's comments quoted'). What exists when the engine starts lives as long as the engine, so
it moves to the permanent generation (`gc.freeze`, as vLLM does after start-up) and
collections walk only what came later.
"""

import atexit
import gc

# Objects still frozen when the interpreter exits are never finalized, and extension
# modules that count their live objects at exit (Triton's nanobind bindings) then report
# them as leaked: hand them back to the collector first.
atexit.register(gc.unfreeze)


def freeze_long_lived() -> None:
    """Exclude every object alive now from future collections (O(1): a list splice)."""
    gc.freeze()


def thaw() -> None:
    """Hand frozen objects back to the collector: the free queue links a pool's blocks
    into cycles, so a dropped pool is reclaimed only by a collection."""
    gc.unfreeze()


def rebase() -> None:
    """After a pool was replaced: reclaim the old one, then freeze the new one."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
