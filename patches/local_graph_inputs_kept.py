"""megatron's local CUDA graphs keep a forward graph's copied-in input buffers for its backward.

Upstream cause: megatron-core 0.16.1 under ``--cuda-graph-impl local`` trains a LoRA Qwen3 (4 layers, H200)
differently from eager: the same loss through iteration 2, then only layer 0's adapters differ after iteration
2 (3.4e-3 in bf16) and every layer's after iteration 3; the losses are 1e-3 apart by iteration 8 (core 0.19:
bit for bit). Read from the source: 0.16.x and 0.17.x ``_CudaGraphRunner.create_fwd_graph`` hands the buffers
it copies a graph's inputs into back to the graphs' reuse pool right after the forward capture ("it will not
be reused after this forward pass"), though the captured forward saved them for its backward. The first
graphed layer's hidden states are such a buffer (no earlier graph outputs them), and the last layer's backward
capture takes it from the pool for its incoming gradient (the same shape), so on replay that gradient
overwrites the first layer's input before the first layer's backward reads it: whatever that backward
computes from its input (the input norm's gradients; a LoRA QKV adapter's A gradient, whose down-projection
recomputes the norm from it) is wrong from the first replayed iteration. megatron-core 0.18.0 no longer
returns them (481efd020e, "bugfixes in local CG implementation that were leading to loss curve gaps").

Fix: while a forward graph is created, the pool keeps what it is handed back out of circulation, as 0.18
does: one more buffer per graph whose inputs are copied in (the first graphed layer's). Backward captures
still return their buffers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .gates import megatron_core_in

NEEDED_FOR = ">=0.16, <0.18 (megatron-core) on CUDA, under --cuda-graph-impl local"


def is_needed() -> bool:
    return torch.cuda.is_available() and megatron_core_in("0.16", "0.18")


def applied() -> bool:
    """Whether megatron's ``create_fwd_graph`` is this patch's wrapper."""
    from megatron.core.transformer.cuda_graphs import _CudaGraphRunner

    return getattr(_CudaGraphRunner.create_fwd_graph, "keeps_inputs", False)


def _kept(tensor: torch.Tensor) -> None:
    """The pool's ``insert`` during a forward capture: the buffer stays with the graph that saved it."""


def keep_inputs(create_fwd_graph: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``create_fwd_graph`` with the reuse pool's ``insert`` a no-op while it runs."""

    @functools.wraps(create_fwd_graph)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

        pool = _CudagraphGlobalRecord.tensor_reuse_pool
        pool.insert = _kept  # the instance attribute shadows TensorReusePool.insert
        try:
            return create_fwd_graph(self, *args, **kwargs)
        finally:
            del pool.insert

    wrapper.keeps_inputs = True
    return wrapper


UNPATCHED = (
    "megatron-core {version} under --cuda-graph-impl local without twinkle-specs' patch local_graph_inputs_kept: "
    "the first graphed layer's backward reads a gradient where its saved input was (upstream returns that "
    "buffer to its pool), so that layer trains wrong (its norm's and a LoRA QKV adapter's A gradients). Run "
    "through `python -m twinkle_specs.launch`, call twinkle_specs.apply_patches() before building the model, "
    "or use --cuda-graph-impl transformer_engine"
)


def warn_if_missing(config: Any) -> None:
    """Warns where a model on these versions uses megatron's local graphs without the patch (stock
    pretrain_gpt.py with the spec, which applies no patches, or $TWINKLE_PATCHES_OFF naming it)."""
    if getattr(config, "cuda_graph_impl", "none") != "local" or not is_needed():
        return
    import warnings

    import megatron.core

    if not applied():
        warnings.warn(UNPATCHED.format(version=megatron.core.__version__), stacklevel=3)


def apply() -> None:
    from megatron.core.transformer.cuda_graphs import _CudaGraphRunner

    if not applied():
        _CudaGraphRunner.create_fwd_graph = keep_inputs(_CudaGraphRunner.create_fwd_graph)
