"""Keep the MoE router's weights on the host when there is no GPU.

Upstream cause: megatron-core 0.16.x-0.19.x ``Router.gating`` moves a CPU router weight to
``torch.cuda.current_device()`` on every forward, so an MoE GPTModel cannot run forward on a CPU-only host
(conversion, parity checks, CI); and its ``router_gating_linear`` names ``te_general_gemm``, which is
undefined when Transformer Engine is absent (NameError). The fix computes the same logits with a plain
linear in the router dtype, only when CUDA is unavailable; GPU training runs upstream code unchanged.
"""

from __future__ import annotations

import torch

from .gates import megatron_core_in

NEEDED_FOR = ">=0.16, <0.20 (megatron-core), CPU-only hosts"


def is_needed() -> bool:
    return not torch.cuda.is_available() and megatron_core_in("0.16", "0.20")


def gating_on_host(self, input: torch.Tensor) -> torch.Tensor:
    """Upstream ``Router.gating`` (logits = input @ weight.T + bias in the router dtype), on the host."""
    router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
        self.config.moe_router_dtype, input.dtype
    )
    bias = None if self.bias is None else self.bias.to(router_dtype)
    return torch.nn.functional.linear(input.to(router_dtype), self.weight.to(router_dtype), bias)


def apply() -> None:
    from megatron.core.transformer.moe.router import Router

    Router.gating = gating_on_host
