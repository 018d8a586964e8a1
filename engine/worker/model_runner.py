"""Loads the model, sizes and owns the KV cache, turns a scheduled step into one forward."""

import contextlib
import logging
import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from kvscope import kernels
from kvscope.engine.config import EngineConfig
from kvscope.engine.core.kv_groups import kv_cache_groups, layers_per_block
from kvscope.engine.core.scheduler_output import ScheduledSequence, SchedulerOutput
from kvscope.engine.worker import cpu_allocator, huge_pages
from kvscope.engine.worker.gguf_weights import (
    GGUF_ARCHITECTURES,
    check_gguf,
    forget_gguf_readers,
    gguf_architecture,
    iter_gguf_weights,
)
from kvscope.engine.worker.loader import (
    gguf_file,
    gguf_metadata,
    iter_weights,
    load_config,
    load_generation_config,
    load_tokenizer,
    resolve_model_path,
)
from kvscope.engine.worker.memory import (
    MemoryPlan,
    device_memory_bytes,
    kv_bytes_per_block,
    measure_peak_bytes,
    plan_blocks,
)
from kvscope.engine.worker.models import language_model_config, model_class
from kvscope.engine.worker.models.attention import AttentionMetadata, PagedAttention
from kvscope.engine.worker.models.bound_ops import bind_kernel_ops
from kvscope.engine.worker.models.layers import prepack_weights
from kvscope.engine.worker.models.moe import ExpertLayout, expert_layout, record_expert_tokens
from kvscope.engine.worker.models.quantized import (
    QuantizedLinear,
    pack_model,
    quantize_model,
    repack_gguf,
    weight_bytes_by_type,
)
from kvscope.engine.worker.models.recurrent import StateMetadata
from kvscope.engine.worker.packed_cache import packed_path, read_packed, store_packed
from kvscope.engine.worker.profile_cache import load_peak, profile_key, store_peak
from kvscope.kernels import KernelOps, kv_quant

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelInputs:
    """One step's forward inputs, copied out of the sequences (ModelRunner.prepare)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    last_rows: list[int]  # the flat rows whose logits are sampled, in schedule order
    chunk_rows: dict[int, tuple[int, int]]  # scheduled index -> its chunk's flat rows
    # State slots whose sequence starts from position 0 this step: zeroed before the forward.
    fresh_slots: list[int]


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use device='cpu'")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, quantization: str = "none",
                  ops: KernelOps | None = None) -> torch.dtype:
    """auto: bfloat16 on CUDA and on CPUs with native bf16 matmuls (AVX512-BF16 or AMX);
    float32 on other CPUs, where bf16 is emulated and runs several times slower than fp32,
    unless the weights are packed (`quantization`) and the kernels (`ops`, else the
    device's) round bf16 activations to int8 (AVX512-VNNI): the linears then run integer
    dots, not bf16 GEMMs, where fp32 activations take the exact kernels (the bf16 path
    several times faster, one stream and batched decode alike: docs/performance-history.md,
    '`dtype="auto"` for packed weights')."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    if quantization != "none":
        packed = (ops or kernels.select_ops(device)).packed
        if packed is not None and packed.rounds_activations_to_int8:
            return torch.bfloat16
    return torch.float32


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = cpuinfo.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def layer_view(slot: torch.Tensor, layer: PagedAttention, dtype: torch.dtype) -> torch.Tensor:
    """A layer's K (or V) cache [blocks, block_size, kv_heads, row] in its slot of the pool,
    whose rows are the widest layer's (ModelRunner.widest_kv_layer): the first kv_heads * row
    values of each token's row; for a layer of the widest shape, the whole slot."""
    blocks, block_size = slot.shape[:2]
    width = layer.num_kv_heads * kv_quant.row_width(layer.head_dim, dtype)
    return slot.flatten(2)[..., :width].view(blocks, block_size, layer.num_kv_heads, -1)


class ModelRunner:
    """Everything on the device: weights, the KV cache, batch inputs and the forward."""

    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        if config.quantization == "gguf":
            # The file itself, no converted folder: config, tokenizer and chat template from
            # its metadata (converted once, gguf_metadata), the weights from its blocks.
            self.model_path = gguf_file(config.model)
            if self.model_path is None:
                raise ValueError(f"model={str(config.model)!r}: no such file; quantization='gguf' "
                                 "reads the blocks of a .gguf file on disk (kvscope never "
                                 "downloads weights)")
            check_gguf(self.model_path)
            metadata = gguf_metadata(self.model_path)
            self.hf_config = language_model_config(load_config(metadata))
            self.tokenizer = load_tokenizer(metadata)
            self.generation_config = GenerationConfig.from_model_config(self.hf_config)
        else:
            self.model_path = resolve_model_path(config.model)
            self.hf_config = language_model_config(load_config(self.model_path))
            self.tokenizer = load_tokenizer(self.model_path)
            self.generation_config = load_generation_config(self.model_path, self.hf_config)
        self.device = resolve_device(config.device)
        # Chosen once, before the weights load (a forced backend that cannot run here fails
        # fast), and handed to everything that calls a kernel.
        self.kernel_ops = kernels.select_ops(self.device)
        self.dtype = resolve_dtype(config.dtype, self.device, config.quantization,
                                   self.kernel_ops)
        self.max_positions = self.hf_config.max_position_embeddings
        architecture = model_class(self.hf_config)
        # Bad length knobs fail before the weights load.
        max_model_len = config.resolved(self.max_positions).max_model_len
        # Quantized layers allocate other temporaries, so the profiled peak depends on these.
        self.quantization = {"quantization": config.quantization,
                             "quantization_group_size": config.quantization_group_size}
        with default_dtype(self.dtype), torch.device(self.device):
            # Every position the model supports: a reconfigure may raise max_model_len later.
            self.model = architecture(self.hf_config, self.max_positions, max_model_len)
            quantize_model(self.model, config.quantization, config.quantization_group_size)
        self.load_weights(config)
        forget_gguf_readers()
        if config.quantization == "gguf" and self.kernel_ops.packed is not None:
            # Before the move to huge pages, so the file's blocks are dropped, not moved.
            repack_gguf(self.model, self.kernel_ops.packed, self.dtype)
        # Before the move to huge pages: the plain weights it replaces are then dropped, not
        # copied first (those oneDNN prepacks live in its memory and stay there).
        in_onednn = []
        prepack = config.prepack_weights
        if prepack is None:
            prepack = self.kernel_ops.prepacks_by_default
        if prepack and self.kernel_ops.prepack_weight is None:
            logger.warning("prepack_weights=True: this backend's kernels cannot read a "
                           "prepacked layout here (the C++ kernels need AVX512-BF16); the "
                           "weights stay in the plain layout")
        elif prepack:
            in_onednn = prepack_weights(self.model, self.kernel_ops.prepack_weight)
        if self.device.type == "cpu":
            huge_pages.move_module(self.model, leave=in_onednn)
            for weight in in_onednn:
                huge_pages.collapse(weight)
            # After the weights' loading, whose temporaries should go back to the system.
            cpu_allocator.reuse_large_blocks()
        self.model.eval()
        # Packed quantized weights are (integer) parameters too, so this is what they occupy.
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.weight_bytes_by_type = weight_bytes_by_type(self.model)
        self.attention_layers = self.model.attention_layers()
        # Recurrent layers (models/recurrent.py), each with a state per sequence in its slot.
        self.state_layers = getattr(self.model, "state_layers", list)()
        # Layers grouped by attention type, each group with its own block tables (set
        # before the decoder stack fuses: it takes each layer's group as an option).
        self.kv_groups = kv_cache_groups([layer.sliding_window for layer in self.attention_layers])
        self.group_windows = tuple(group.window for group in self.kv_groups)
        self.layers_per_block = layers_per_block(self.kv_groups)
        for index, group in enumerate(self.kv_groups):
            for layer in group.layers:
                self.attention_layers[layer].kv_group = index
        bind_kernel_ops(self.model, self.kernel_ops)
        quantized = sum(isinstance(module, QuantizedLinear) for module in self.model.modules())
        if quantized and self.kernel_ops.packed is None:
            logger.warning("no kernels for packed weights on the %s backend: the %d quantized "
                           "layers de-quantize their weights on every forward (correct, but "
                           "slower than dense)", self.kernel_ops.backend, quantized)
        # Each MoE layer's tokens per expert in the latest forward (before the stack fuses:
        # it writes them too).
        self.expert_tokens = record_expert_tokens(self.model)
        self.expert_layout: ExpertLayout | None = expert_layout(self.model, self.hf_config)
        fuse = getattr(self.model, "fuse_decoder_stack", None)
        self.fused_decoder_stack = (fuse is not None and not config.enforce_eager
                                    and self.kernel_ops.decoder_stack is not None)
        if self.fused_decoder_stack:
            fuse(self.dtype)
        elif fuse is None and self.kernel_ops.decoder_stack is not None:
            logger.info("%s runs its eager layers: %s", type(self.model).__name__,
                        getattr(self.model, "no_decoder_stack_reason",
                                "the C++ decoder stack does not run its layers"))
        self.kv_cache: torch.Tensor | None = None
        self.swap_cache: torch.Tensor | None = None
        self._peak_activation_bytes: dict[tuple[int, int, int], int] = {}
        logger.info("loaded %s (%s, %.1f MiB of weights: %s, quantization=%s, %s on %s) in %.1f s;"
                    " %s kernels, %s", self.model_path,
                    type(self.model).__name__, self.weight_bytes / (1 << 20),
                    ", ".join(f"{name} {size / (1 << 20):.1f} MiB"
                              for name, size in self.weight_bytes_by_type.items()),
                    config.quantization,
                    self.dtype, self.device, time.perf_counter() - started,
                    self.kernel_ops.backend,
                    "one-call decoder stack" if self.fused_decoder_stack else "eager layers")

    def load_weights(self, config: EngineConfig) -> None:
        """The checkpoint into the model, packed for its quantization. A quantized GGUF
        model is packed once: later starts read its packed state from the cache."""
        source = gguf_file(config.model) if config.quantization != "none" else None
        # GGUF blocks are kept as the file stores them: nothing to pack, nothing to cache.
        cache = None if source is None or config.quantization == "gguf" else packed_path(
            source, config.quantization, config.quantization_group_size, self.dtype)
        state = None if cache is None else read_packed(cache)
        if state is not None:
            pack_model(self.model, self.dtype, self.device)  # the layout, then the values
            self.model.load_state_dict(state)
            logger.info("packed %s weights read from %s", config.quantization, cache)
            return
        self.model.load_weights(self.checkpoint_weights(source, config.quantization == "gguf"))
        pack_model(self.model, self.dtype, self.device)
        if cache is not None:
            store_packed(self.model, cache)

    def checkpoint_weights(self, source, keep_blocks: bool):
        """The HF folder's tensors; for a quantized model's Llama GGUF (`source`, else None),
        the file's own blocks instead (Q4_1 layers then pack into int4 without a round trip
        through fp32; `keep_blocks`: every block tensor kept as it is)."""
        if source is not None and gguf_architecture(source) in GGUF_ARCHITECTURES:
            logger.info("reading the quantized blocks of %s directly", source)
            return iter_gguf_weights(source, self.hf_config, keep_blocks)
        return iter_weights(self.model_path)

    def bytes_per_block(self, block_size: int, kv_cache_dtype: str = "auto") -> int:
        """K and V for block_size tokens in a KV cache group's layers (every layer, for a
        model of one attention type), scales included."""
        heads, head_dim = self.widest_kv_layer(kv_cache_dtype)
        return kv_bytes_per_block(self.layers_per_block, block_size, heads, head_dim, self.dtype,
                                  kv_cache_dtype)

    def bytes_per_state_slot(self) -> int:
        """One sequence's state in every recurrent layer (0 without recurrent layers)."""
        return sum(layer.slot_bytes() for layer in self.state_layers)

    def widest_kv_layer(self, kv_cache_dtype: str = "auto") -> tuple[int, int]:
        """(kv_heads, head_dim) of the attention layer whose K (or V) rows take the most room:
        every layer slot of a block is that wide (Gemma 4's sliding and full layers differ in
        shape; a narrower layer leaves the rest of its slot unused, as vLLM pads its pages)."""
        dtype = kv_quant.cache_dtype(kv_cache_dtype, self.dtype)
        return max(((layer.num_kv_heads, layer.head_dim) for layer in self.attention_layers),
                   key=lambda shape: shape[0] * kv_quant.row_width(shape[1], dtype))

    def plan_memory(self, config: EngineConfig, draft: "ModelRunner | None" = None) -> MemoryPlan:
        """Size the block pool for a resolved config (profiling its token budget once per
        model, machine and code version: later starts read the peak from disk). A draft
        model (speculative decoding) comes out of the same budget: its weights, its K/V for
        every block, and its activations (its forwards run beside what the target's leave)."""
        kv_dtype = config.kv_cache_dtype
        peak = self.peak_activation_bytes(config)
        draft_weights = draft_per_block = auto_draft_per_block = 0
        if draft is not None:
            draft_weights = draft.weight_bytes
            draft_per_block = draft.bytes_per_block(config.block_size, kv_dtype)
            auto_draft_per_block = draft.bytes_per_block(config.block_size)
            peak += draft.peak_activation_bytes(config)
        return plan_blocks(
            device_memory_bytes(self.device, config.device_memory_gb),
            config.gpu_memory_utilization, self.weight_bytes + draft_weights, peak,
            self.bytes_per_block(config.block_size, kv_dtype) + draft_per_block,
            config.block_size, config.max_model_len, config.num_gpu_blocks_override,
            tuple(self.kv_groups), draft_weights, draft_per_block, self.weight_bytes_by_type,
            kv_cache_dtype=kv_dtype,
            auto_bytes_per_block=self.bytes_per_block(config.block_size) + auto_draft_per_block,
            bytes_per_state_slot=self.bytes_per_state_slot(), max_num_seqs=config.max_num_seqs,
            num_state_layers=len(self.state_layers))

    def peak_activation_bytes(self, config: EngineConfig) -> int:
        key = (config.max_num_batched_tokens, config.max_model_len, config.max_num_seqs)
        if key not in self._peak_activation_bytes:
            self._peak_activation_bytes[key] = self._cached_peak_activations(*key)
        return self._peak_activation_bytes[key]

    def _cached_peak_activations(self, num_tokens: int, max_model_len: int,
                                 max_seqs: int) -> int:
        key = profile_key(self.model_path, self.dtype, self.device,
                          self.kernel_ops.backend,
                          {"num_tokens": num_tokens, "max_model_len": max_model_len,
                           "max_num_seqs": max_seqs, **self.quantization})
        peak = load_peak(key)
        if peak is None:
            peak = self.profile_peak_activations(num_tokens, max_model_len, max_seqs)
            store_peak(key, peak)
        return peak

    def profile_peak_activations(self, num_tokens: int, max_model_len: int, max_seqs: int) -> int:
        """One forward over a full token budget (as sequences of at most max_model_len) plus
        logits for max_num_seqs rows, measured on the device."""
        block_size = 16
        lengths = [max_model_len] * (num_tokens // max_model_len)
        if num_tokens % max_model_len:
            lengths.append(num_tokens % max_model_len)
        blocks_per_seq = -(-max(lengths) // block_size) * len(self.kv_groups)
        self.allocate_kv_cache(block_size, blocks_per_seq * len(lengths))
        self.allocate_state_slots(len(lengths))
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
                  for i in range(len(lengths))]
        input_ids, positions, meta = self._flat_inputs(
            [(0, n, table) for n, table in zip(lengths, tables)], block_size,
            token_ids=lambda index, start, end: [0] * (end - start),
            state_slots=list(range(len(lengths))))

        def forward():
            with torch.inference_mode():
                hidden = self.model(input_ids, positions, meta)
                self.model.compute_logits(hidden[-1:].expand(max_seqs, -1))

        peak = measure_peak_bytes(forward, self.device)
        self.kv_cache = None
        self.allocate_state_slots(0)
        logger.info("profiling forward of %d tokens peaked at %.1f MiB of activations",
                    num_tokens, peak / (1 << 20))
        return peak

    def allocate_kv_cache(self, block_size: int, num_blocks: int,
                          kv_cache_dtype: str = "auto") -> None:
        """Zeroed [2, layers_per_block, blocks, block_size, kv_heads, row]; each attention
        layer gets the K and V views of its slot in its KV cache group (the i-th layer of
        every group shares slot i: a block belongs to one group at a time), so block copies
        and swaps move all of a block's layers at once. A row is head_dim values, or for a
        quantized kv_cache_dtype head_dim codes and their scale (kernels/kv_quant.py): the
        scales move with their blocks."""
        # A pool still being populated is finished first: the thread holds its memory.
        huge_pages.wait_resident()
        self.kv_cache = None
        for layer in self.attention_layers:
            layer.key_cache = layer.value_cache = None
        dtype = kv_quant.cache_dtype(kv_cache_dtype, self.dtype)
        heads, head_dim = self.widest_kv_layer(kv_cache_dtype)
        shape = (2, self.layers_per_block, num_blocks, block_size, heads,
                 kv_quant.row_width(head_dim, dtype))
        # Made resident in the background: the engine waits for it before its next step
        # (wait_until_resident).
        self.kv_cache = (huge_pages.empty(shape, dtype, background=True) if self.device.type == "cpu"
                         else torch.zeros(shape, dtype=dtype, device=self.device))
        for group in self.kv_groups:
            for slot, index in enumerate(group.layers):
                layer = self.attention_layers[index]
                layer.key_cache, layer.value_cache = (
                    layer_view(self.kv_cache[part, slot], layer, dtype) for part in (0, 1))
        self.block_size = block_size

    def allocate_state_slots(self, num_slots: int) -> None:
        """Zeroed [num_slots, *shape] tensors for each state of each recurrent layer (one
        slot per running sequence, engine.core.state_slots); 0 frees them."""
        for layer in self.state_layers:
            layer.states = {name: torch.zeros((num_slots, *shape), dtype=dtype,
                                              device=self.device)
                            for name, (shape, dtype) in layer.state_shapes().items()}

    def copy_state_slots(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole slots (every recurrent layer's states): a fork's child starts from its
        parent's state."""
        sources = torch.tensor([s for s, _ in copies], device=self.device)
        targets = torch.tensor([t for _, t in copies], device=self.device)
        for layer in self.state_layers:
            for state in layer.states.values():
                state[targets] = state[sources]

    def wait_until_resident(self) -> None:
        """Return once the KV pools allocate_kv_cache made are resident: they are populated
        in the background (huge_pages.empty), and the engine waits before each step, so no
        forward pays their page faults."""
        huge_pages.wait_resident()

    def allocate_swap_space(self, num_blocks: int) -> None:
        """The CPU pool that swapped-out sequences' blocks are copied to (pinned on CUDA, so
        copies are DMA transfers)."""
        self.swap_cache = None
        if num_blocks:
            self.swap_cache = torch.zeros(
                (*self.kv_cache.shape[:2], num_blocks, *self.kv_cache.shape[3:]),
                dtype=self.kv_cache.dtype, device="cpu", pin_memory=self.device.type == "cuda")

    def copy_blocks(self, copies: list[tuple[int, int]], source: torch.Tensor,
                    target: torch.Tensor) -> None:
        """Copy whole blocks (all layers, K and V): copy-on-write, swap out, swap in."""
        sources = torch.tensor([s for s, _ in copies], device=source.device)
        targets = torch.tensor([t for _, t in copies], device=target.device)
        target[:, :, targets] = source[:, :, sources].to(target.device)

    def read_kv_blocks(self, block_ids: list[int]) -> list:
        """Each block's bytes (every layer's K and V, scales too) as one host buffer: what
        the disk tier writes (engine.core.kv_offload.tier.KVBlockIO)."""
        blocks = torch.stack([self.kv_cache[:, :, block] for block in block_ids]).cpu()
        return list(blocks.view(torch.uint8).reshape(len(block_ids), -1).numpy())

    def write_kv_blocks(self, block_ids: list[int], payloads: list) -> None:
        """Put read_kv_blocks' buffers (loaded from the disk tier) back into blocks."""
        shape = self.kv_cache[:, :, 0].shape
        data = torch.stack([torch.frombuffer(payload, dtype=torch.uint8) for payload in payloads])
        data = data.view(self.kv_cache.dtype).view(len(block_ids), *shape)
        targets = torch.tensor(block_ids, device=self.kv_cache.device)
        self.kv_cache[:, :, targets] = data.movedim(0, 2).to(self.kv_cache.device)

    def _flat_inputs(self, pieces, block_size: int, token_ids,
                     state_slots: list[int] | None = None):
        """Flatten (start, end, block_table) pieces into the attention op's ragged layout,
        one slot mapping and block table per KV cache group (each piece's table interleaves
        its groups' tables, as Sequence.block_table does); with recurrent layers, each
        piece's state slot (`state_slots`) goes along (models/recurrent.py)."""
        groups = len(self.kv_groups)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(groups)]
        tables: list[list[list[int]]] = [[] for _ in range(groups)]
        seq_lens: list[int] = []
        query_start_loc = [0]
        width = max(len(table) for _, _, table in pieces) // groups
        for index, (start, end, table) in enumerate(pieces):
            input_ids.extend(token_ids(index, start, end))
            span = range(start, end)
            positions.extend(span)
            for group in range(groups):
                own = table[group::groups]
                slots[group].extend(own[p // block_size] * block_size + p % block_size
                                    for p in span)
                tables[group].append(own + [0] * (width - len(own)))
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + end - start)
        device = self.device

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        state = (StateMetadata.build(query_start_loc, state_slots, device)
                 if self.state_layers else None)
        meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.int64), block_tables=tensor(tables, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            query_start_loc=tensor(query_start_loc, torch.int32), state=state)
        return tensor(input_ids, torch.int64), tensor(positions, torch.int64), meta

    @torch.inference_mode()
    def forward_rows(self, pieces: list[tuple[int, int, list[int]]], token_ids: list[list[int]],
                     rows: list[int]) -> torch.Tensor | None:
        """One forward over (start, end, block_table) pieces holding `token_ids` (one list
        per piece), writing their K/V; the logits of flat rows `rows` (None if none). A
        draft model's steps run this way (engine.spec_decode.draft_model)."""
        input_ids, positions, meta = self._flat_inputs(
            pieces, self.block_size, token_ids=lambda index, start, end: token_ids[index])
        hidden = self.model(input_ids, positions, meta)
        return self.model.compute_logits(hidden[rows]) if rows else None

    @torch.inference_mode()
    def move_blocks(self, plan: SchedulerOutput) -> None:
        """Swaps and copy-on-write copies, before anything writes into the blocks: a block
        swapped out may be handed to another sequence in this same step."""
        for copies, source, target in ((plan.swap_out, self.kv_cache, self.swap_cache),
                                       (plan.swap_in, self.swap_cache, self.kv_cache),
                                       (plan.block_copies, self.kv_cache, self.kv_cache)):
            if copies:
                self.copy_blocks(copies, source, target)
        if plan.state_copies:
            self.copy_state_slots(plan.state_copies)

    def prepare(self, scheduled: list[ScheduledSequence], all_positions: tuple[int, ...] = ()
                ) -> ModelInputs:
        """The forward's inputs as tensors of their own: what `execute` reads."""
        input_ids, positions, meta = self._flat_inputs(
            [(s.start, s.end, s.seq.block_table) for s in scheduled], self.block_size,
            token_ids=lambda index, start, end: scheduled[index].input_token_ids(),
            state_slots=[s.seq.state_slot for s in scheduled])
        last_rows, end = [], 0  # each sampling sequence's last tokens in the flat batch
        for item in scheduled:
            end += item.end - item.start
            if item.samples:
                last_rows.extend(range(end - 1 - len(item.spec_token_ids), end))
        starts = meta.query_start_loc.tolist() if all_positions else []
        fresh = [s.seq.state_slot for s in scheduled if s.start == 0] if self.state_layers else []
        return ModelInputs(input_ids, positions, meta, last_rows,
                           {i: (starts[i], starts[i + 1]) for i in all_positions}, fresh)

    @torch.inference_mode()
    def execute(self, inputs: ModelInputs) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run one forward over the ragged batch. Returns logits [rows, vocab] in fp32 for
        each scheduled sequence that reaches its last token, in schedule order: one row, or
        with k proposed tokens k + 1 rows (the last own token's and each proposal's, which
        verify the proposals and give the token after them); and for each scheduled index
        `prepare` was given in `all_positions`, the logits of every position of its chunk
        (prompt logprobs)."""
        if inputs.fresh_slots:
            fresh = torch.tensor(inputs.fresh_slots, device=self.device)
            for layer in self.state_layers:
                for state in layer.states.values():
                    state[fresh] = 0
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        chunk_logits = {i: self.model.compute_logits(hidden[start:end])
                        for i, (start, end) in inputs.chunk_rows.items()}
        rows = inputs.last_rows
        # A batch of decodes that all sample is every row, in order: no gather.
        sampled = hidden if len(rows) == hidden.shape[0] else hidden[rows]
        return self.model.compute_logits(sampled), chunk_logits
