"""Runs app.py (the rest of the command line) in this process, and every PROBE_S seconds
appends the process's RSS and its count of Python objects the collector tracks to the JSON
lines file named by $KVSCOPE_SOAK_PROBE (bench/soak.py reads it)."""

import gc
import json
import os
import runpy
import sys
import threading
import time
from pathlib import Path

PROBE_S = float(os.environ.get("KVSCOPE_SOAK_PROBE_S", "15"))


def rss_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def probe(path: Path) -> None:
    while True:
        # Frozen objects (the start-up heap, re-frozen after each reconfigure: see
        # engine/orchestrator/heap.py) are not in get_objects() but are alive all the same.
        objects = len(gc.get_objects()) + gc.get_freeze_count()
        sample = {"t": time.time(), "rss_bytes": rss_bytes(), "objects": objects}
        with path.open("a") as out:
            out.write(json.dumps(sample) + "\n")
        time.sleep(PROBE_S)


if __name__ == "__main__":
    threading.Thread(target=probe, args=(Path(os.environ["KVSCOPE_SOAK_PROBE"]),),
                     name="kvscope-soak-probe", daemon=True).start()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
