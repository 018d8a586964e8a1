"""Building blocks shared by the model files: merged projections and RMSNorm."""

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from kvscope.engine.worker.models.bound_ops import UsesKernelOps
from kvscope.engine.worker.models.quantized import (
    GroupQuantized,
    QuantizedLinear,
    dense,
    part_rows,
)
from kvscope.kernels import PrepackedWeight, reference


class Prepacks:
    """A module whose weight the kernels may keep in their prepacked layout (Linear, and
    the token embedding of a model whose logits read it)."""

    prepacked: PrepackedWeight | None = None

    def reset_parameters(self) -> None:
        """No random start: every weight comes from the checkpoint (load_weights checks that
        each was set), and nn.Linear's kaiming init was a fifth of a 0.4B model's load
        (docs/performance-history.md, 'GGUF files against llama.cpp on the same file', load
        time)."""

    def prepack(self, prepack_weight: Callable[[torch.Tensor], PrepackedWeight | None]) -> None:
        """Keep the weight only in the kernels' prepacked layout (where they take it): the
        parameter becomes the tiles, so nothing is held twice, and the PrepackedWeight holds
        that parameter, so the kernels read it wherever it moves (huge_pages.move_module)."""
        prepacked = prepack_weight(self.weight.data)
        if prepacked is not None:
            self.weight = nn.Parameter(prepacked.blocks, requires_grad=False)
            self.prepacked = dataclasses.replace(prepacked, blocks=self.weight)

    def projection(self) -> "torch.Tensor | PrepackedWeight":
        """The weight as the kernels' linear takes it: the prepacked one where there is one."""
        return self.weight if self.prepacked is None else self.prepacked


class Linear(Prepacks, nn.Linear, UsesKernelOps):
    """nn.Linear through the bound kernels (a single row streams its weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.projection(), self.bias)


class Embedding(Prepacks, nn.Embedding):
    """The token embedding. Where the logits read it too (tied word embeddings), it may be
    kept in tiles only: the lookup then gathers each token's row from them."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.prepacked is None:
            return super().forward(input_ids)
        return reference.blocked_rows(self.weight, input_ids, self.embedding_dim)


class MergedLinear(Linear):
    """Several projections of the same input as one matmul (q/k/v, gate/up).

    The checkpoint stores each part under its own name; `load_part` copies one into its
    rows, so the model runs one large matmul instead of two or three small ones.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes

    def load_part(self, param_name: str, index: int, tensor: "torch.Tensor | GroupQuantized") -> None:
        getattr(self, param_name).data[part_rows(self.output_sizes, index)].copy_(dense(tensor))

    def split(self, output: torch.Tensor) -> list[torch.Tensor]:
        return list(output.split(self.output_sizes, dim=-1))


class RMSNorm(UsesKernelOps):
    """Llama's RMSNorm, normalising in fp32 as transformers does; given the residual
    stream, it first adds hidden into it (in place) and normalises the sum."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.ops.rms_norm(hidden, self.weight, self.eps, residual)


class LoadsOwnTensors:
    """A module that places the checkpoint tensors under its name itself (a MoE layer's
    experts, whose checkpoints name them in more than one layout) and knows which of its
    parts are still unset."""

    def load_tensor(self, name: str, tensor, checkpoint_name: str) -> None:
        """A checkpoint tensor, `name` relative to this module (`checkpoint_name`: its whole
        name, for errors)."""
        raise NotImplementedError

    def unloaded(self) -> list[str]:
        """Its parts no checkpoint tensor has set yet (relative names)."""
        raise NotImplementedError


def load_weights(
    model: nn.Module, weights, packed: dict[str, tuple[str, int]], skip: set[str] = frozenset()
) -> None:
    """Copy checkpoint tensors into the model, routing packed parts into merged projections
    and the tensors under a LoadsOwnTensors module to it.

    `packed` maps a checkpoint module name ("q_proj") to (merged module, part index);
    names in `skip` (e.g. a tied lm_head) are ignored. Every model parameter must be set.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    owners = {path: module for path, module in modules.items()
              if isinstance(module, LoadsOwnTensors)}
    # Quantized layers stage their weight until packing, so it is no parameter yet.
    expected = {name for name in set(params) | {f"{path}.weight" for path, module in modules.items()
                                                if isinstance(module, QuantizedLinear)}
                if _owner(name, owners) is None}
    loaded: set[str] = set()
    for name, tensor in weights:
        if name in skip or "rotary_emb" in name:
            continue
        owner = _owner(name, owners)
        if owner is not None:
            owners[owner].load_tensor(name[len(owner) + 1:], tensor, name)
            continue
        module_path, _, param_name = name.rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        if leaf in packed:
            merged_leaf, index = packed[leaf]
            module_path = f"{parent}.{merged_leaf}"
            modules[module_path].load_part(param_name, index, tensor)
        elif isinstance(modules.get(module_path), QuantizedLinear):
            modules[module_path].load_part(param_name, None, tensor)
        elif name in params:
            params[name].data.copy_(dense(tensor))
        else:
            raise ValueError(f"model: checkpoint tensor {name!r} has no place in {type(model).__name__}")
        loaded.add(f"{module_path}.{param_name}")
    missing = sorted(expected - loaded - skip) + [
        f"{path}.{part}" for path, owner in owners.items() for part in owner.unloaded()]
    if missing:
        raise ValueError(f"model: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _owner(name: str, owners: dict[str, LoadsOwnTensors]) -> str | None:
    """The path of the LoadsOwnTensors module a tensor name lies under, if any."""
    if not owners:
        return None
    parts = name.split(".")
    return next((path for i in range(len(parts) - 1, 0, -1)
                 if (path := ".".join(parts[:i])) in owners), None)


def prepack_weights(model: nn.Module, prepack_weight: Callable[[torch.Tensor], PrepackedWeight | None]
                    ) -> list[torch.Tensor]:
    """Prepack every Linear's weight, and the token embedding of a model whose logits read
    it (`tied`); returns the weights that now live in oneDNN's memory (its AMX tiles), which
    must stay where they are."""
    in_onednn = []
    tied = getattr(model, "tied", False)
    for name, module in model.named_modules():
        table = name.rpartition(".")[2] in ("lm_head", "embed_tokens")
        if isinstance(module, Linear) or (tied and table and isinstance(module, Embedding)):
            module.prepack(prepack_weight)
            if module.prepacked is not None and module.prepacked.onednn is not None:
                in_onednn.append(module.weight)
    return in_onednn
