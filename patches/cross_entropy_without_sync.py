"""Transformer Engine's fused cross entropy without its host sync in every backward.

Upstream cause: TE's ``cross_entropy_backward`` (TE 2.7+) tests ``torch.equal(grad_output,
torch.tensor(1.0, device=...))`` to skip one multiply when the loss was the last op. Building that
``torch.tensor`` is a pageable host-to-device copy, which synchronises the stream: the host waits for the
whole forward before it issues the backward. megatron-core 0.16.x-0.19.x passes ``is_cg_capturable=True``,
which skips the test, only under full-iteration CUDA graphs. For megatron the test is never true: its loss
is per token, so ``grad_output`` has shape ``[s, b]`` and never equals a 0-d tensor, and TE multiplies
anyway. Passing ``is_cg_capturable=True`` always gives the same gradients without the sync.
"""

from __future__ import annotations

import functools

import torch

from .gates import megatron_core_in

NEEDED_FOR = ">=0.16, <0.20 (megatron-core) on CUDA, Transformer Engine >= 2.7"


def is_needed() -> bool:
    if not torch.cuda.is_available() or not megatron_core_in("0.16", "0.20"):
        return False
    from megatron.core.models.common.language_module import language_module
    from megatron.core.utils import is_te_min_version

    return language_module.te_parallel_cross_entropy is not None and is_te_min_version("2.7.0")


def without_sync(te_parallel_cross_entropy):
    """megatron's ``te_parallel_cross_entropy`` with ``is_cg_capturable`` always on."""

    @functools.wraps(te_parallel_cross_entropy)
    def wrapper(logits, labels, tp_group, is_cg_capturable: bool = False):
        return te_parallel_cross_entropy(logits, labels, tp_group, True)

    wrapper.without_sync = True
    return wrapper


def apply() -> None:
    """``LanguageModule.compute_language_model_loss`` calls the name its module imported."""
    from megatron.core.models.common.language_module import language_module

    if not getattr(language_module.te_parallel_cross_entropy, "without_sync", False):
        language_module.te_parallel_cross_entropy = without_sync(language_module.te_parallel_cross_entropy)
