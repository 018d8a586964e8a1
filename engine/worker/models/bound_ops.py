"""How a model's modules reach the kernels: each holds the KernelOps the model runner
chose at start-up, bound once (bind_kernel_ops); until then, the plain-torch twins."""

from torch import nn

from kvscope.kernels import TORCH_OPS, KernelOps


class UsesKernelOps(nn.Module):
    """A module that calls its kernels through `self.ops`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: KernelOps = TORCH_OPS


def bind_kernel_ops(model: nn.Module, ops: KernelOps) -> None:
    for module in model.modules():
        if isinstance(module, UsesKernelOps):
            module.ops = ops
