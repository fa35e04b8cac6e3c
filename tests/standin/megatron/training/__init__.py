"""Stand-in for Megatron-LM's megatron.training (CPU tests of twinkle_specs.launch)."""

from .global_vars import get_args
from .training import pretrain

__all__ = ["get_args", "pretrain"]
