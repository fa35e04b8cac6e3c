"""Transformer Engine's ``_extra_state`` for the portable modules that stand in for TE modules.

A low-level module (it imports nothing of twinkle_specs): the LoRA layers and the checkpoint converter
both use it.
"""

from __future__ import annotations

from typing import Any

import torch


class TEExtraState:
    """Mixin: a module's checkpoint holds TE's (empty, non-FP8) ``_extra_state``, as the TE module it
    stands for does."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        """Nothing to restore."""
