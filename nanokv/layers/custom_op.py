"""One switch between the C kernels (nanokv/kernels) and torch, made once per model.

A layer with a C path is a CustomOp (vLLM's pattern): forward_native is the torch
implementation (any device, any dtype), forward_cpu the one on the C kernels. At build,
choose_kernels() decides for the whole model, in one place, and KernelChoice.apply()
switches every CustomOp over: prepare_cpu() packs its weights and returns the
implementation `forward` is bound to from then on. No layer tests a flag per call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import nanokv.kernels as kernels
from nanokv.layers.activation import SILU_NAMES, check_activation

logger = logging.getLogger("nanokv")


@dataclass(frozen=True)
class KernelChoice:
    """C kernels or torch, for one model (the runner keeps it: runner.kernels)."""

    cpu: bool  # every CustomOp runs forward_cpu (the C kernels); else forward_native (torch)
    fused_layers: bool  # the decoder layers run as one C call each (kernels/fused_layers.py)
    attention_backend: str  # the config's; "torch" in place of "cpu" when the kernels did not build
    weights: str = "float32"  # how the projections' weights are packed (kernels.FORMATS)
    lm_head: str = "float32"  # and the LM head's

    def apply(self, model: nn.Module) -> None:
        """Switch a freshly loaded model over (nothing to do for torch)."""
        if not self.cpu:
            return
        # children first: a parent's prepare_cpu sees its children packed
        for m in reversed(list(model.modules())):
            if isinstance(m, CustomOp):
                m.use_cpu_kernels(self)
        kernels.release_free_memory()  # the unpacked weights' pages


def choose_kernels(dtype: torch.dtype, device: torch.device, attention_backend: str, hf_config,
                   tp_size: int, weights: str | None = None, lm_head: str | None = None) -> KernelChoice:
    """The C kernels for float32 activations on the CPU, when they build (the first call here
    compiles them; EngineConfig only checked that they could), with the projection and LM
    head weights packed as `weights` / `lm_head` (EngineConfig.weight_format /
    lm_head_format; None: float32). The decoder layers fuse into one C call each for one
    rank, SiLU (the activation the C layer applies) and the cpu attention backend (whose
    metadata the C layer reads). Kernels that do not build: int8 weights are refused,
    bfloat16 ones run on the torch path in float32 (warned)."""
    cpu = dtype == torch.float32 and device.type == "cpu" and kernels.available()
    if not cpu and weights == "int8":
        raise ValueError("quantization='int8' runs on the CPU kernels, which did not build here (see the "
                         "warning above); drop quantization to run the float32 weights")
    if not cpu and weights == "bfloat16":
        logger.warning("bfloat16 weights need the CPU kernels, which did not build: running float32 weights")
    backend = "torch" if attention_backend == "cpu" and not cpu else attention_backend  # available() warned
    fused = cpu and tp_size == 1 and backend == "cpu" and check_activation(hf_config) in SILU_NAMES
    if not cpu:
        return KernelChoice(False, False, backend)

    def packed(fmt):  # quantization="int8": the int8 layout this library computes fastest
        return kernels.int8_format() if fmt == "int8" else fmt or "float32"

    return KernelChoice(cpu, fused, backend, packed(weights), packed(lm_head))


class CustomOp(nn.Module):
    """A layer with a torch and a C-kernel implementation; `forward` is bound to one."""

    cpu_kernels = False  # switched to the C kernels (KernelChoice.apply)

    def __init__(self):
        super().__init__()
        self.forward = self.forward_native

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):
        raise NotImplementedError

    def prepare_cpu(self, choice: KernelChoice) -> Callable:
        """Get ready for the C kernels (pack weights, once) and return the implementation
        to run: forward_cpu, or forward_native for an op whose own C path does not apply
        (its children still run theirs)."""
        return self.forward_cpu

    def use_cpu_kernels(self, choice: KernelChoice) -> None:
        self.forward = self.prepare_cpu(choice)
        self.cpu_kernels = True
