"""The disk tier's fingerprint, and the tier opened for an engine.

The fingerprint names everything that makes a block's bytes differ for the same tokens:
the model files' content, the dtype, kv_cache_dtype, block_size, the weights'
quantization, the rope settings, the pool's shape per block and the kernels' cache layout
version. It salts every key and names the tier's folder, so a tier written under another
fingerprint is never read.
"""

import hashlib
import json
import logging
from pathlib import Path

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.kv_cache_manager import KVCacheManager
from kvscope.engine.core.kv_events import KVEventSink
from kvscope.engine.core.kv_offload.disk_store import open_disk_store
from kvscope.engine.core.kv_offload.tier import KVTier
from kvscope.engine.worker.model_runner import ModelRunner
from kvscope.kernels import kv_quant
from kvscope.kernels.cache import cache_dir

logger = logging.getLogger(__name__)
ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
               "rope_local_base_freq", "max_position_embeddings")
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".gguf")
CHUNK = 1 << 24


def model_files_digest(model_path: Path) -> str:
    """sha256 over the model files' names and content, hashed once per version of the
    files: remembered under kvscope's cache folder by their paths, sizes and mtimes."""
    model_path = Path(model_path).resolve()
    files = sorted([model_path] if model_path.is_file() else
                   [p for p in model_path.iterdir() if p.suffix in MODEL_FILE_SUFFIXES])
    stamp = hashlib.sha256(json.dumps([(str(p), p.stat().st_size, p.stat().st_mtime_ns)
                                       for p in files]).encode()).hexdigest()
    remembered = cache_dir() / "model_digests" / stamp
    if remembered.is_file():
        return remembered.read_text()
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        with open(path, "rb") as file:
            while chunk := file.read(CHUNK):
                digest.update(chunk)
    remembered.parent.mkdir(parents=True, exist_ok=True)
    remembered.write_text(digest.hexdigest())
    return digest.hexdigest()


def kv_fingerprint(config: EngineConfig, runner: ModelRunner) -> str:
    """32 hex digits naming what the blocks' bytes depend on (a ModelRunner with its KV
    cache allocated)."""
    hf_config = runner.hf_config
    cache = runner.kv_cache
    parts = {
        "model_files": model_files_digest(runner.model_path),
        "dtype": str(runner.dtype), "kv_cache_dtype": config.kv_cache_dtype,
        "cache_dtype": str(cache.dtype), "block_size": config.block_size,
        "quantization": [config.quantization, config.quantization_group_size],
        "rope": {name: getattr(hf_config, name, None) for name in ROPE_FIELDS},
        "block_shape": [cache.shape[0], cache.shape[1], *cache.shape[3:]],
        "groups": list(runner.group_windows),
        "layout_version": kv_quant.CACHE_LAYOUT_VERSION,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()
                          ).hexdigest()[:32]


def open_kv_tier(config: EngineConfig, runner, kv_cache: KVCacheManager,
                 emit: KVEventSink) -> KVTier | None:
    """The tier config.kv_offload_dir asks for, or None (not asked, or it cannot be used:
    a warning names the setting and the engine runs without it)."""
    if config.kv_offload_dir is None:
        return None
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        logger.warning("kv_offload_dir=%r: a draft model's K/V is not saved with the "
                       "target's; the engine runs without the disk tier",
                       config.kv_offload_dir)
        return None
    if kv_cache.state_slots is not None:
        logger.warning("kv_offload_dir=%r: the model's recurrent layers keep their state in "
                       "slots the tier does not save, so a block loaded from it could not "
                       "skip the recurrence; the engine runs without the disk tier",
                       config.kv_offload_dir)
        return None
    if not isinstance(runner, ModelRunner):
        logger.warning("kv_offload_dir=%r: %s holds no KV tensors to save (the replay's "
                       "simulator); the engine runs without the disk tier",
                       config.kv_offload_dir, type(runner).__name__)
        return None
    store = open_disk_store(config.kv_offload_dir, config.kv_offload_gb,
                            kv_fingerprint(config, runner))
    if store is None:
        return None
    logger.info("KV disk tier at %s: %d blocks (%.1f MiB) found, %.1f GiB at most",
                store.folder, store.num_blocks, store.num_bytes / (1 << 20),
                store.capacity_bytes / (1 << 30))
    return KVTier(store, kv_cache, runner, emit)
