"""The one-call C++ decoder stack (kvscope.LlamaDecoderStack) over a model's own modules:
the Llama family (llama.py, its mixtures of experts included) and Gemma 2/3 (gemma.py) hand
it their weights once, then run every step through it unless enforce_eager is set."""

import torch
from torch import nn

from kvscope.engine.worker.models.attention import AttentionMetadata
from kvscope.engine.worker.models.layers import Linear
from kvscope.engine.worker.models.moe import Experts, SparseMoeBlock
from kvscope.engine.worker.models.quantized import GgufLinear, Int4Linear, kernel_max_rows
from kvscope.kernels import EXPERT_ACTIVATIONS


def stack_tensors(layer: nn.Module) -> dict[str, torch.Tensor]:
    """A layer's tensors for the C++ stack: its parameters by name, but a prepacked linear's
    weight as "<module>.tiles" and, where oneDNN laid it out, its oneDNN tensor as
    "<module>.onednn"; each GGUF layer's runs as "<module>.gguf_parts"; and a MoE layer's
    row of the runner's expert_tokens as "<experts>.token_counts"."""
    tensors = dict(layer.named_parameters())
    for name, module in layer.named_modules():
        if isinstance(module, Linear) and module.prepacked is not None:
            tensors[f"{name}.tiles"] = tensors.pop(f"{name}.weight")
            if module.prepacked.onednn is not None:
                tensors[f"{name}.onednn"] = module.prepacked.onednn
        if isinstance(module, GgufLinear):
            tensors[f"{name}.gguf_parts"] = module.parts_table()
        if isinstance(module, Experts) and module.token_counts is not None:
            tensors[f"{name}.token_counts"] = module.token_counts
    return tensors


def stack_table(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """An embedding's or an output projection's table for the C++ stack: its rows (or its
    tiles, where it is prepacked: layers.Prepacks), their int8 scales (None unless int8),
    and their GGUF type (-1 unless GGUF blocks: one run)."""
    if isinstance(module, GgufLinear):
        (part,), (weight,) = module.parts, module.weights
        return weight, None, part.code
    return module.weight, getattr(module, "scales", None), -1


def moe_options(layer: nn.Module) -> dict[str, int]:
    """A MoE layer's routing for the stack's LayerOptions (none for a dense layer)."""
    if not isinstance(layer.mlp, SparseMoeBlock):
        return {}
    moe = layer.mlp.gate.moe
    return {"top_k": moe.top_k, "normalize_top_k": int(moe.normalize_top_k),
            "round_weights": int(moe.round_weights),
            "expert_activation": EXPERT_ACTIVATIONS.index(moe.activation)}


def tile_outputs(module: nn.Module) -> float:
    """The outputs per tile of a table kept in tiles (0.0 where it is plain), for the stack's
    model options."""
    prepacked = getattr(module, "prepacked", None)
    return 0.0 if prepacked is None else float(prepacked.out_features // prepacked.blocks.shape[0])


class FusedDecoderStack:
    """The token embedding, every decoder layer and the final norm in one C++ call
    (kvscope.LlamaDecoderStack), and the output projection in another.

    It chains the same C++ ops the modules call, with the same weights (dense, int4 / int8
    packed, or a GGUF file's blocks), so the result is the modules' result; what it saves is the Python
    between ~300 module and op calls, which costs a batch-1 decode step milliseconds. The
    weights are handed over once, here; a step passes only its own inputs. The model
    runner fuses it where the bound kernels have one (KernelOps.decoder_stack) unless
    enforce_eager is set.

    What the stack reads from the model (FusesDecoderStack's models have all of it):
    `model.model` with embed_tokens, layers, norm and a rotary module whose `tables()` are
    its (cos, sin) pairs and whose `query_scale` is each position's query scale (or None);
    each layer's `kind.stack_options()` (the C++ LayerOptions by name), and a MoE layer's
    routing (moe_options); the model's `stack_options()` (the C++ ModelOptions by name);
    `tied` and `lm_head` where the output projection is not the embedding.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        body = model.model
        self.attention = [layer.self_attn.attn for layer in body.layers]
        first = self.attention[0]
        tables = body.rotary.tables()
        # The token embedding and the rotary lookups run in the same call, the output
        # projection in a second: called from Python after a step has streamed the weights,
        # their small ops and the Python around them would run cold
        # (docs/performance-history.md, 'Fused ops, sampling and the decoder stack').
        projection = body.embed_tokens if model.tied else model.lm_head
        embedding, embedding_scales, embedding_type = stack_table(body.embed_tokens)
        head, head_scales, head_type = stack_table(projection)
        gguf_types = {name: float(kind) for name, kind in (("embedding_gguf_type", embedding_type),
                                                             ("head_gguf_type", head_type))
                      if kind >= 0}
        tiles = {"embedding_tile": tile_outputs(body.embed_tokens),
                 "head_tile": tile_outputs(projection)}
        self.layers = model.ops.decoder_stack(
            embedding=embedding, embedding_scales=embedding_scales,
            head=head, head_scales=head_scales,
            cos=[cos for cos, _ in tables], sin=[sin for _, sin in tables],
            query_scale=body.rotary.query_scale,
            final_norm=body.norm.weight,
            # Each layer's tensors by their parameter names (packed int4 / int8 linears add
            # scales, and int4 offsets, to weight and bias; GGUF layers have weights.0,
            # weights.1...; the C++ side reads them by name), with stack_tensors' extras.
            layers=[stack_tensors(layer) for layer in body.layers],
            layer_options=[{**layer.kind.stack_options(), **moe_options(layer),
                            "kv_group": layer.self_attn.attn.kv_group} for layer in body.layers],
            model_options={**model.stack_options(), **gguf_types, **tiles},
            num_heads=first.num_heads, num_kv_heads=first.num_kv_heads, head_dim=first.head_dim,
            group_size=next((module.group_size for module in model.modules()
                             if isinstance(module, Int4Linear)), 0),
            # Every packed linear of a model streams alike (a model held in lanes further).
            kernel_max_rows=next((module.stream_rows(model.ops.packed, dtype)
                                  for module in model.modules() if isinstance(module, GgufLinear)),
                                 kernel_max_rows(model.ops.packed, dtype)),
            eps=body.norm.eps,
            attention_scale=first.scale)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the final norm's rows, as the model's compute_logits gives them."""
        return self.layers.logits(hidden)

    def __call__(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        # The cache views change when the pool is resized, so they are read per call.
        return self.layers.forward(
            input_ids, positions, [layer.key_cache for layer in self.attention],
            [layer.value_cache for layer in self.attention], meta.slot_mapping,
            meta.block_tables, meta.seq_lens, meta.query_start_loc)


class FusesDecoderStack:
    """A model the runner may run through the C++ stack: its forward and compute_logits
    call `decoder_stack` once it is set."""

    decoder_stack: FusedDecoderStack | None = None

    def fuse_decoder_stack(self, dtype: torch.dtype) -> None:
        """Run the layers as one call from now on (needs bound kernels with a decoder stack)."""
        self.decoder_stack = FusedDecoderStack(self, dtype)
