"""A layer's output written straight into the next layer's CUDA-graph input, under Transformer Engine's
per-layer CUDA graphs (``--cuda-graph-impl transformer_engine``).

Each captured layer reads a static input buffer (the sample megatron makes for it,
``get_layer_static_inputs``) and writes its output into memory of the graphs' pool; on replay, Transformer
Engine copies each layer's input into that layer's buffer unless it is that buffer already. So every layer
paid a copy of the hidden states per micro-batch ([4096, 4096] bf16 read and written at the Qwen3-8B shape).
Here the layer's last operation, the residual add (megatron's bias-dropout-add with no bias and no active
dropout), writes into the next layer's buffer while it is captured, so the replayed output *is* the next
input and only the first layer's input (the embedding's output) is copied. The sum is the same
``residual + x`` rounded once.

Only where each layer has one sample buffer (:func:`record_sample`): one pipeline stage, where megatron and
Transformer Engine reuse a layer's buffer for every micro-batch; with micro-batches in flight on several
stages a layer has several, and its output goes to the graphs' pool as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

# on the model's TransformerConfig: {layer_number: [weak references to the hidden_states samples made for it]}
_SAMPLES = "_twinkle_graph_samples"


def record_sample(layer: torch.nn.Module, hidden_states: torch.Tensor) -> None:
    """Remembers a CUDA-graph sample input megatron made for ``layer`` (global ``layer_number``). Weakly: the
    graphs keep their buffers alive, and a copy of the config does not copy them."""
    samples = layer.config.__dict__.setdefault(_SAMPLES, {})
    samples.setdefault(layer.layer_number, []).append(weakref.ref(hidden_states))


def _next_input(layer: torch.nn.Module, like: torch.Tensor) -> torch.Tensor | None:
    """The next decoder layer's one sample buffer, where ``like`` (this layer's output) fits it exactly. The
    last decoder layer has none (a multi-token-prediction layer numbered after it takes other input)."""
    buffers = layer.config.__dict__.get(_SAMPLES, {}).get(layer.layer_number + 1, [])
    if len(buffers) != 1 or layer.layer_number >= layer.config.num_layers:
        return None
    buffer = buffers[0]()
    if buffer is None:
        return None
    fits = buffer.shape == like.shape and buffer.dtype == like.dtype and buffer.device == like.device
    return buffer if fits and buffer.is_contiguous() else None


class _AddInto(torch.autograd.Function):
    """``out = residual + x`` written into ``out`` (a detached alias of the next layer's sample)."""

    @staticmethod
    def forward(ctx, residual: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        torch.add(residual, x, out=out)
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, grad, None


class OutputIntoNextInput:
    """Wraps a layer's ``mlp_bda`` (called ``mlp_bda(training, fused)(x_with_bias, residual, prob)``): under
    a CUDA-graph capture with the next layer's sample known, the add goes into that sample; otherwise
    megatron's own function runs."""

    def __init__(self, layer: torch.nn.Module, bda: Callable[..., Callable]) -> None:
        self.layer, self.bda = layer, bda

    def __call__(self, training: bool, fused: bool) -> Callable:
        inner = self.bda(training, fused)

        def bias_dropout_add(x_with_bias: tuple, residual: torch.Tensor, prob: float) -> torch.Tensor:
            x, bias = x_with_bias
            plain = bias is None and (prob == 0.0 or not training)
            same = x.shape == residual.shape and x.dtype == residual.dtype
            if plain and same and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                out = _next_input(self.layer, residual)
                if out is not None:
                    return _AddInto.apply(residual, x, out.detach())
            return inner(x_with_bias, residual, prob)

        return bias_dropout_add


def write_output_into_next_input(layer: Any) -> None:
    """Installs :class:`OutputIntoNextInput` around ``layer.mlp_bda``."""
    layer.mlp_bda = OutputIntoNextInput(layer, layer.mlp_bda)
