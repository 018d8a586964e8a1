"""kill -9 during the disk tier's writes: writer processes (two by default, sharing the
directory and writing the same blocks, as two engines on one --kv-offload-dir would) write
block files through the tier's DiskStore until they are SIGKILLed at a random moment; then
a restart rebuilds the index from the directory and reads every block back. Prints JSON.

After each kill: the index is rebuilt from the files; no dead writer's temporary file is
left; every block served is byte for byte what was written (its content is a function of
its key), and any file that fails its checks is deleted and counted, never served.

    python bench/kv_tier_crash.py --kills 20
"""

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from served import cpu_name

from kvscope.engine.core.kv_offload.block_file import SUFFIX, TMP_SUFFIX
from kvscope.engine.core.kv_offload.disk_store import DiskStore

FINGERPRINT = "5a" * 16
BLOCK_BYTES = 368 * 1024  # a block of 16 tokens of SmolLM2-135M's K/V in bf16


def payload_of(key: bytes, size: int = BLOCK_BYTES) -> bytes:
    return (key * (size // len(key) + 1))[:size]


def write_forever(root: str, first_key: int) -> None:
    store = DiskStore(Path(root), FINGERPRINT, 1 << 40)
    for index in range(first_key, first_key + 10**9):
        key = index.to_bytes(16, "little")
        store.put(key, payload_of(key))


def check_restart(root: Path) -> dict:
    """A restart's view of the directory: what it indexed, served, and caught."""
    folder = root / FINGERPRINT
    leftovers = len(list(folder.glob(f"*{TMP_SUFFIX}")))
    store = DiskStore(root, FINGERPRINT, 1 << 40)
    files, indexed = len(list(folder.glob(f"*{SUFFIX}"))), store.num_blocks
    served = wrong = 0
    for key in store.keys():
        payload = store.get(key)
        if payload is not None:
            served += 1
            wrong += bytes(payload) != payload_of(key)
    return {"tmp_files_at_kill": leftovers,
            "tmp_files_after_restart": len(list(folder.glob(f"*{TMP_SUFFIX}"))),
            "files": files, "indexed": indexed, "served": served, "wrong_served": wrong,
            "corrupt_deleted": store.num_corrupt_deleted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--writer", nargs=2, metavar=("DIR", "FIRST_KEY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.writer:
        write_forever(args.writer[0], int(args.writer[1]))
        return
    rng = random.Random(args.seed)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="kv-tier-crash-") as root:
        for kill in range(args.kills):
            # Overlapping key ranges: the writers race on the same blocks.
            first = kill * 50
            writers = [subprocess.Popen([sys.executable, __file__, "--writer", root,
                                         str(first + 10 * w)]) for w in range(args.writers)]
            # Killed at a random moment once both are writing (starting takes a while).
            folder = Path(root) / FINGERPRINT
            before = len(list(folder.glob(f"*{SUFFIX}"))) if folder.exists() else 0
            deadline = time.monotonic() + 120
            while (time.monotonic() < deadline and
                   len(list(folder.glob(f"*{SUFFIX}"))) < before + 2 * args.writers):
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.2))
            for writer in writers:
                writer.send_signal(signal.SIGKILL)
            for writer in writers:
                writer.wait()
            rounds.append(check_restart(Path(root)))
    print(json.dumps({
        "kills": args.kills, "writers_per_round": args.writers,
        "block_bytes": BLOCK_BYTES,
        "blocks_served_over_restarts": sum(r["served"] for r in rounds),
        "wrong_blocks_served": sum(r["wrong_served"] for r in rounds),
        "corrupt_files_deleted": sum(r["corrupt_deleted"] for r in rounds),
        "tmp_files_left_by_kills": sum(r["tmp_files_at_kill"] for r in rounds),
        "tmp_files_after_restarts": sum(r["tmp_files_after_restart"] for r in rounds),
        "index_rebuilt_every_time": all(r["indexed"] == r["files"] for r in rounds),
        "rounds": rounds,
        "cpu": cpu_name(),
    }, indent=1))


if __name__ == "__main__":
    main()
