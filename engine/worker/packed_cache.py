"""Quantized weights of a GGUF model, packed once and kept on disk.

Reading a GGUF file block by block parses all of its metadata (the tokenizer's included)
and decodes every tensor: tens of seconds on a small CPU, on every start. After the first
start the packed model's state is saved under <kvscope cache dir>/packed/<key>.pt; the key
hashes the file's path, size and mtime, the quantization knobs, the dtype, the torch
version and the code that decides the packed layout, so any change to those packs afresh.
"""

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from kvscope.engine.worker import gguf_weights
from kvscope.engine.worker.models import quantized
from kvscope.kernels.cache import cache_dir

logger = logging.getLogger(__name__)
LAYOUT_SOURCES = (Path(quantized.__file__), Path(gguf_weights.__file__))


def packed_path(gguf: Path, quantization: str, group_size: int, dtype: torch.dtype) -> Path:
    stat = gguf.stat()
    digest = hashlib.sha256()
    parts = [str(gguf.resolve()), str(stat.st_size), str(stat.st_mtime_ns), quantization,
             str(group_size), str(dtype), torch.__version__]
    for part in [part.encode() for part in parts] + [s.read_bytes() for s in LAYOUT_SOURCES]:
        digest.update(part)
        digest.update(b"\0")
    return cache_dir() / "packed" / f"{gguf.stem}-{quantization}-{digest.hexdigest()[:16]}.pt"


def read_packed(path: Path) -> dict[str, torch.Tensor] | None:
    """The cached state (memory-mapped), or None when there is no usable file."""
    if not path.is_file():
        return None
    try:
        return torch.load(path, mmap=True, weights_only=True)
    except (OSError, RuntimeError) as error:  # unreadable or truncated: pack afresh
        logger.warning("ignoring the packed weights in %s (%s)", path, error)
        return None


def store_packed(model: nn.Module, path: Path) -> None:
    """Save the packed model's state atomically; a failure only costs the next start time."""
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as file:
            temporary = Path(file.name)
            torch.save(model.state_dict(), file)
        os.replace(temporary, path)
    except OSError as error:
        logger.warning("could not cache the packed weights in %s (%s)", path, error)
        if temporary is not None:
            temporary.unlink(missing_ok=True)
