"""EngineConfig: every engine knob in one validated dataclass."""

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from kvscope.engine.speculative_config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
MAX_BLOCK_SIZE = 256
QUANTIZATIONS = ("none", "int8", "int4", "gguf")
QUANTIZATION_GROUP_SIZES = (32, 64, 128, 256)  # what the packed int4 CPU matmul accepts
# vLLM's names; fp8 is fp8_e4m3 (kvscope.kernels.kv_quant has the format)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
BLOCK_SIZES = tuple(2 ** i for i in range(MAX_BLOCK_SIZE.bit_length()))  # 1, 2, ..., 256


@dataclass(slots=True)
class EngineConfig:
    """Knobs of one engine; `None` means "derive from the model or the other knobs"."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    # Weight-only: int8 per output channel, or int4 with a scale and zero per group of
    # quantization_group_size inputs; activations and the KV cache keep `dtype`. "gguf":
    # a GGUF model's tensors kept in the blocks its file stores (Q4_K, Q6_K, Q8_0, ...).
    # None (unset): "gguf" for a .gguf file, served as it ships (vLLM infers it from the
    # file too), else "none"; an explicit "none" de-quantizes a GGUF, int4 / int8 re-pack it.
    quantization: str | None = None
    quantization_group_size: int = 32
    # vLLM's name: True runs the model layer by layer from Python (the oracle path); by
    # default a Llama-family model on the C++ CPU kernels runs its decoder stack in one call.
    enforce_eager: bool = False
    # bf16 dense weights kept once in tiles for bf16 dot products (kernels' prepack_weight).
    # On AVX512-BF16 CPUs without AMX, kvscope's own 64-output tiles; with AMX, oneDNN's
    # 32-output tiles streamed through AMX's tile multiply. Either way batches are faster
    # and one stream about as fast or faster, so None (unset) means on wherever the kernels
    # stream the tiles (kernels' prepacks_by_default); measured in
    # docs/performance-history.md, "kvscope's own 64-output tiles" and 'Decode batches
    # through AMX itself' (issues 37, 28).
    prepack_weights: bool | None = None
    block_size: int = 16
    # auto: the model's dtype; fp8 / fp8_e4m3 / fp8_e5m2 / int8: one code per value and a
    # scale per token and KV head, about half the bytes per block (kernels/kv_quant.py)
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    # The CPU has no device memory to measure, so the utilization applies to this size;
    # 2 GiB leaves ~3,400 blocks of 16 tokens for the default model in bfloat16.
    device_memory_gb: float = 2.0
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    num_gpu_blocks_override: int | None = None
    seed: int = 0
    enable_prefix_caching: bool = True
    # A model with recurrent layers (engine.core.state_slots): with prefix caching, the
    # state is snapshot where a prefill chunk ends on a multiple of this many blocks (the
    # scheduler ends chunks there), so a prefix hit restores it and skips the recurrence.
    # Fewer snapshots (larger N) hold fewer slots; a hit lands on a snapshot's boundary. A
    # prompt running past a boundary in one chunk is cut there: one more step to its end.
    state_snapshot_every_n_blocks: int = 8
    enable_chunked_prefill: bool = True
    # None: fair by default, a prefill chunk takes at most a quarter of the budget while
    # other requests wait; 0: never capped; N: every prefill chunk capped at N tokens.
    long_prefill_token_threshold: int | None = None
    preemption_mode: str = "recompute"
    # vLLM's knob: "fcfs" serves in arrival order; "priority" serves the lowest request
    # priority first and preempts lower-priority running requests for it, each waited
    # priority_aging_steps scheduler steps counting as one priority level (the aging
    # bound, engine.core.scheduling_policy).
    scheduling_policy: str = "fcfs"
    priority_aging_steps: int = 1000
    swap_space: float = 1.0
    # vLLM's speculative decoding (engine.spec_decode): a SpeculativeConfig, or a dict of
    # its fields (method, num_speculative_tokens, prompt_lookup_min/max, model); None: off.
    speculative_config: SpeculativeConfig | dict | None = None
    # vLLM's knob: the forward runs on a thread of its own and the engine schedules the next
    # step (and makes this one's outputs) while it runs (EngineCore.step). Off by default:
    # on a 2-core CPU the engine's Python competes with the forward's threads for the
    # cores (docs/performance-history.md, 'Async scheduling on a 2-core CPU').
    async_scheduling: bool = False
    # A disk tier below the pool (engine/core/kv_offload): blocks the prefix cache evicts
    # are written to files under this directory, kv_offload_gb of them at most, and loaded
    # back for a later prompt with that prefix, in this process or the next (a warm
    # restart). None: no tier.
    kv_offload_dir: str | None = None
    kv_offload_gb: float = 4.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the knob, its value and the allowed range."""
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("device", self.device, DEVICES)
        if self.quantization is None:
            self.quantization = "gguf" if is_gguf_path(self.model) else "none"
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        if self.quantization == "gguf" and self.model is not None and not is_gguf_path(self.model):
            raise ValueError(f"quantization='gguf' keeps a GGUF file's blocks, so model must be a "
                             f".gguf file (or None, the default GGUF), not {self.model!r}")
        if (type(self.quantization_group_size) is not int
                or self.quantization_group_size not in QUANTIZATION_GROUP_SIZES):
            raise ValueError(f"quantization_group_size={self.quantization_group_size!r} must be "
                             f"one of {list(QUANTIZATION_GROUP_SIZES)}")
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _check_positive_int("priority_aging_steps", self.priority_aging_steps)
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager={self.enforce_eager!r} must be True or False")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling={self.async_scheduling!r} must be True or False")
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError("async_scheduling=True with speculative_config set: a step's "
                             "proposals depend on the tokens the step before accepts, so "
                             "the next step cannot be scheduled before they are known; "
                             "turn one of them off")
        self._validate_kv_offload()
        if self.prepack_weights is not None and not isinstance(self.prepack_weights, bool):
            raise ValueError(f"prepack_weights={self.prepack_weights!r} must be True, False or "
                             "None (the CPU's default)")
        bs = self.block_size
        if (isinstance(bs, bool) or not isinstance(bs, int) or not 1 <= bs <= MAX_BLOCK_SIZE
                or bs & (bs - 1)):
            raise ValueError(
                f"block_size={bs!r} must be a power of two between 1 and {MAX_BLOCK_SIZE}")
        util = self.gpu_memory_utilization
        if not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization={util!r} must be in (0, 1]")
        if not isinstance(self.device_memory_gb, (int, float)) or self.device_memory_gb <= 0:
            raise ValueError(f"device_memory_gb={self.device_memory_gb!r} must be > 0")
        _check_positive_int("max_model_len", self.max_model_len, optional=True)
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        _check_positive_int("state_snapshot_every_n_blocks", self.state_snapshot_every_n_blocks)
        _check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens, optional=True)
        _check_positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override,
                            optional=True)
        if not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an integer")
        threshold = self.long_prefill_token_threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int)
                                      or threshold < 0):
            raise ValueError(f"long_prefill_token_threshold={threshold!r} must be an integer "
                             ">= 0 (0 = no cap) or None (a fair cap while others wait)")
        if not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space={self.swap_space!r} must be >= 0 (GiB)")
        if (not self.enable_chunked_prefill and self.max_num_batched_tokens is not None
                and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len}; with enable_chunked_prefill=False a "
                "whole prompt must fit in one step's budget")

    def _validate_kv_offload(self) -> None:
        if self.kv_offload_dir is not None and (not isinstance(self.kv_offload_dir, str)
                                                or not self.kv_offload_dir.strip()):
            raise ValueError(f"kv_offload_dir={self.kv_offload_dir!r} must be a directory path "
                             "(a non-empty string) or None (no disk tier)")
        size = self.kv_offload_gb
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
            raise ValueError(f"kv_offload_gb={size!r} must be > 0 (GiB of disk for the tier)")
        if self.kv_offload_dir is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offload_dir is set with enable_prefix_caching=False: the disk "
                             "tier keeps the prefix cache's blocks; turn prefix caching on or "
                             "leave kv_offload_dir unset")

    def resolved(self, model_max_len: int) -> "EngineConfig":
        """A copy with every `None` length knob filled in from the model's limit."""
        if self.max_model_len is not None and self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={model_max_len}")
        max_model_len = self.max_model_len or min(model_max_len, 8192)
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if self.enable_chunked_prefill else max_model_len
        return replace(self, max_model_len=max_model_len, max_num_batched_tokens=budget)

    def with_changes(self, **knobs: Any) -> "EngineConfig":
        """A validated copy with some knobs changed; unknown knobs are refused."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(knobs) - known)
        if unknown:
            raise ValueError(f"unknown engine knob(s) {unknown}; known: {sorted(known)}")
        return replace(self, **knobs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_gguf_path(model: Any) -> bool:
    """Whether the `model` knob names a .gguf file (None, the default model, does not)."""
    return model is not None and str(model).endswith(".gguf")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {list(choices)}")


def _check_positive_int(name: str, value: object, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")
