"""A frozen base's FP8 weight copies kept across iterations, eager and under TE's CUDA graphs.

Transformer Engine quantizes an FP8 linear's weight on a forward whose ``is_first_microbatch`` is True and
reuses that copy (and its transpose, for the input-gradient GEMM) while it is False; megatron asks for a
new copy at every iteration's first micro-batch, because trained weights change at each optimizer step.
A LoRA base is frozen, so its copies stay right until a base weight itself changes.

Eager, each base linear decides for itself (:class:`~.te_layers.FrozenFp8WeightCache`). Under TE's CUDA
graphs (``--cuda-graph-impl transformer_engine``) the modules' flags are not read: megatron passes
``is_first_microbatch`` (micro-batch 0) to each layer's graph, and the first graphed layer of a forward
sets one GPU flag that every captured weight quantization reads. There the choice is the model chunk's:
:class:`FrozenFp8Copies` lets its layers' graphs keep their copies once the same, unchanged base weights
have been quantized as often as the recipe needs. At Qwen3-8B's shape that skips reading about 7 billion
bf16 weights and writing them twice in FP8 at every iteration.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..parallel import is_adapter_param

# Training quantizations of an unchanged weight until its FP8 copy is final. Delayed scaling quantizes with
# a scale from amaxes seen before (the initial 1.0 the first time, which flushes small weights to FP8's
# subnormals), so its second copy is the first scaled by the weight's own amax; the current-scaling recipes
# scale every copy by the weight itself. A recipe not named here keeps megatron's behaviour.
COPIES_TO_SETTLE = {"delayed": 2, "tensorwise": 1, "blockwise": 1, "mxfp8": 1}


def copies_to_settle(config: Any) -> int:
    """How many quantizations of an unchanged frozen weight make its FP8 copy final under ``config``'s
    recipe; 0 without FP8 or with a recipe whose quantizer this does not know."""
    if config is None or not getattr(config, "fp8", None):
        return 0
    recipe = getattr(config, "fp8_recipe", None)
    return COPIES_TO_SETTLE.get(getattr(recipe, "value", recipe), 0)


def weights_stamp(weights: list[torch.Tensor]) -> tuple | None:
    """What identifies the weights' values (storage and in-place version of each: a load, a merge or an
    unmerge writes a weight in place); None if one of them trains."""
    if any(w.requires_grad for w in weights):
        return None
    return tuple((w.data_ptr(), w._version) for w in weights)


class Fp8CopyHistory:
    """The training quantizations of a frozen base's FP8 copy so far: of which weights (their stamp) and
    how many in a row; the eager linears (:class:`~.te_layers.FrozenFp8WeightCache`) and a chunk's graphs
    (:class:`FrozenFp8Copies`) keep one each."""

    def __init__(self) -> None:
        self.stamp: tuple | None = None
        self.runs = 0

    def quantized(self, stamp: tuple | None) -> None:
        """A copy was made of the weights that ``stamp`` identifies (None: one not to keep)."""
        self.runs = self.runs + 1 if stamp is not None and stamp == self.stamp else 1
        self.stamp = stamp

    def final(self, current: Callable[[], tuple | None], settle: int) -> bool:
        """Whether the copy is the one every later training forward would make of the weights as they are
        now: the last ``settle`` quantizations were of these very weights. ``current`` gives their stamp; it
        is called only once such copies exist (not before a first quantization, e.g. while TE's constructor
        sets its flag before the LoRA layer's state exists)."""
        return self.stamp is not None and self.runs >= settle and current() == self.stamp


class FrozenFp8Copies:
    """Whether a model chunk's graphed layers quantize their weights again on a first micro-batch.

    The first layer that asks leads: TE takes the flag of a forward's first graphed module for all of them,
    so the lead layer decides once per iteration and the others follow. A chunk whose base weights are
    unchanged since the last ``settle`` quantizations keeps its copies; one that trains, or whose weights
    changed, quantizes again as megatron asks.
    """

    def __init__(self, weights: list[torch.Tensor], settle: int):
        self._weights = weights
        self._settle = settle
        self._history = Fp8CopyHistory()
        self._lead: object | None = None
        self._quantize = True
        self.kept_from: int | None = None  # the chunk's first iteration that kept its copies

    def first_microbatch(self, layer: object, requested: bool) -> bool:
        """The ``is_first_microbatch`` that ``layer``'s graph replays with, where megatron asked for
        ``requested``."""
        if self._lead is None:
            self._lead = layer
        if requested and layer is self._lead:
            self._quantize = self._must_quantize()
        return requested and self._quantize

    def _must_quantize(self) -> bool:
        current = functools.partial(weights_stamp, self._weights)
        if not self._history.final(current, self._settle):
            self._history.quantized(current())
            return True
        if self.kept_from is None:
            self.kept_from = self._history.runs + 1
            _announce(f"the frozen base's FP8 weight copies are kept from its iteration {self.kept_from} on")
        return False


def share_frozen_fp8_copies(chunk: torch.nn.Module) -> None:
    """Gives every transformer layer of ``chunk`` (``lora_fp8_copies``) one :class:`FrozenFp8Copies` over
    the layers' base weights, where the run is FP8 with a recipe that :func:`copies_to_settle` knows."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layers = [m for m in chunk.modules() if isinstance(m, TransformerLayer)]
    settle = copies_to_settle(layers[0].config) if layers else 0
    if not settle:
        return
    weights = [p for layer in layers for name, p in layer.named_parameters() if not is_adapter_param(name)]
    copies = FrozenFp8Copies(weights, settle)
    for layer in layers:
        layer.lora_fp8_copies = copies


def _announce(message: str) -> None:
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_rank() == 0:
        print(f"twinkle_specs: LoRA under FP8 and TE CUDA graphs: {message}", flush=True)
