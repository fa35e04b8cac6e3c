"""Model-level LoRA training setup: freeze the base, keep gradients flowing under recompute, merge."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..parallel import is_adapter_param, model_chunks
from .layers import LoraLayerMixin


def lora_modules(model) -> Iterator[tuple[int, str, LoraLayerMixin]]:
    """(chunk index, module name, LoRA layer) for every LoRA layer of this rank's model chunks."""
    for i, chunk in enumerate(model_chunks(model)):
        for name, module in chunk.named_modules():
            if isinstance(module, LoraLayerMixin) and module.lora_slots:
                yield i, name, module


def adapter_parameters(model) -> list[torch.nn.Parameter]:
    """The trainable parameters of a LoRA model: every adapter factor, nothing else."""
    return [p for chunk in model_chunks(model) for n, p in chunk.named_parameters() if is_adapter_param(n)]


def _require_grad_hook(_module: torch.nn.Module, _inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.requires_grad_(True) if not output.requires_grad else output


def prepare_lora_model(model) -> None:
    """Freezes every base parameter (embeddings, norms, output layer too) and keeps adapters trainable.

    With the embedding frozen, the decoder's input does not require grad, so a fully recomputed layer
    block (megatron's reentrant checkpoint) produces an output without a graph and its adapters never
    get gradients. As PEFT's ``enable_input_require_grads`` does, the embedding output is made to
    require grad (a leaf with no weight gradient to compute), which lets that backward run. Stages
    without the embedding receive activations that already require grad. Idempotent.
    """
    if not adapter_parameters(model):
        raise ValueError(
            "prepare_lora_model: the model has no LoRA factors; build it with lora=LoraConfig(...)"
        )
    for chunk in model_chunks(model):
        for name, param in chunk.named_parameters():
            param.requires_grad_(is_adapter_param(name))
        embedding = getattr(chunk, "embedding", None)
        if embedding is not None and not getattr(chunk, "_lora_input_hook", None):
            chunk._lora_input_hook = embedding.register_forward_hook(_require_grad_hook)


def merge_lora(model) -> None:
    """Folds every adapter into its base weight (fp32 arithmetic, cast once to the weight's dtype).

    Afterwards the base weights are the merged model (``save_hf_weights`` exports it) and the adapters
    are skipped in forward. :func:`unmerge_lora` restores the exact base.
    """
    for _, _, module in lora_modules(model):
        module.merge()


def unmerge_lora(model) -> None:
    """Restores the base weights bit-for-bit and re-enables the adapters."""
    for _, _, module in lora_modules(model):
        module.unmerge()
