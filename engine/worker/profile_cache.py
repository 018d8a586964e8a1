"""The profiling forward's peak, remembered on disk keyed by everything it depends on.

On the CPU that forward is the slowest part of a start (tens of seconds for a 2,048-token
budget). Its result depends only on the model's files, the dtype, the device, the shapes
profiled, the code that runs the forward and the libraries under it; with all of them in
the key, a repeated start with the same model, knobs and machine reads the number back,
and any change profiles afresh.
"""

import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

import torch

from kvscope import kernels
from kvscope.kernels.cache import cache_dir

logger = logging.getLogger(__name__)
# The code a profiling forward runs: a change to any of it changes what it allocates.
CODE_GLOBS = ((Path(__file__).resolve().parent, ("models/**/*.py", "model_runner.py", "memory.py")),
              (Path(kernels.__file__).resolve().parent, ("**/*.py", "**/*.cpp", "**/*.h")))
LIBRARIES = ("torch", "triton", "numpy")
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".pt")


def profile_cache_dir() -> Path:
    """$KVSCOPE_PROFILE_CACHE, else `profiles` under kvscope's cache folder."""
    configured = os.environ.get("KVSCOPE_PROFILE_CACHE")
    return Path(configured).expanduser() if configured else cache_dir() / "profiles"


def _digest(paths: Iterable[Path], with_content: bool) -> str:
    """sha256 over file names and either their content or (cheaper, for weights) their
    size and modification time."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(str(path).encode())
        if with_content:
            digest.update(path.read_bytes())
        else:
            stat = path.stat()
            digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def _library_versions() -> dict[str, str | None]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_key(model_path: Path, dtype: torch.dtype, device: torch.device,
                attention_backend: str, shapes: dict[str, int]) -> dict:
    """Everything the profiled peak depends on, as a JSON-able dict."""
    model_files = ([Path(model_path)] if Path(model_path).is_file()  # a GGUF served as it is
                   else [p for p in Path(model_path).iterdir() if p.suffix in MODEL_FILE_SUFFIXES])
    code_files = {p for root, patterns in CODE_GLOBS for pattern in patterns for p in root.glob(pattern)}
    return {
        "model": str(Path(model_path).resolve()),
        "model_files": _digest(model_files, with_content=False),
        "dtype": str(dtype), "device": str(device), "device_name": _device_name(device),
        "torch_threads": torch.get_num_threads(), "attention_backend": attention_backend,
        "code": _digest(code_files, with_content=True), "libraries": _library_versions(),
        "python": platform.python_version(), **shapes,
    }


def entry_path(folder: Path, key: dict) -> Path:
    """The file of `key`'s entry in `folder`: named by a hash of the key."""
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return folder / f"{name}.json"


def read_entry(folder: Path, key: dict) -> dict | None:
    """The entry stored for exactly this key, or None (missing, unreadable, other key)."""
    try:
        entry = json.loads(entry_path(folder, key).read_text())
    except (OSError, ValueError):
        return None
    # Compared as JSON reads it back (a tuple in the key is a list in the file).
    same = isinstance(entry, dict) and entry.get("key") == json.loads(json.dumps(key))
    return entry if same else None


def write_entry(folder: Path, key: dict, fields: dict) -> Path | None:
    """Store `fields` under the key; returns the file, or None where it cannot be written
    (a cache that cannot be written costs the next start time, nothing else, so the
    failure is logged, not raised)."""
    path = entry_path(folder, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write a sibling and rename: a crash or a concurrent start never leaves half a file.
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False,
                                         suffix=".tmp") as staging:
            json.dump({"key": key, **fields}, staging, indent=1)
        os.replace(staging.name, path)
    except OSError as error:
        logger.warning("could not cache a profiling result in %s: %s", path, error)
        return None
    return path


def load_peak(key: dict) -> int | None:
    """The remembered peak for exactly this key, or None."""
    entry = read_entry(profile_cache_dir(), key)
    if entry is None or not isinstance(entry.get("peak_activation_bytes"), int):
        return None
    logger.info("reused the profiled activation peak from %s (delete it to profile again)",
                entry_path(profile_cache_dir(), key))
    return entry["peak_activation_bytes"]


def store_peak(key: dict, peak_bytes: int) -> None:
    write_entry(profile_cache_dir(), key, {"peak_activation_bytes": peak_bytes})
