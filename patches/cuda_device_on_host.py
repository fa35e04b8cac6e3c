"""Let tensor/expert-parallel collectives and dist-checkpoint I/O run on the host when there is no GPU.

Upstream cause: megatron-core 0.16.x-0.19.x ``tensor_parallel/mappings.py`` allocates the output of its
gathers and reduce-scatters with ``device=torch.cuda.current_device()`` (five places), and so does the
``GlobalMemoryBuffer`` in ``core/utils.py`` that some of them use, so MoE token dispatch (which gathers
along the sequence) and vocab-parallel logit gathers cannot run on a CPU host, even on gloo; and the
``torch_dist`` checkpoint writer calls ``torch.cuda.synchronize()`` and allocates its status tensors on
``torch.cuda.current_device()``, so ``dist_checkpointing.save`` fails there too; and
``YarnRotaryEmbedding.get_emb`` moves its frequencies to ``torch.cuda.current_device()`` (from its
constructor on), so a YaRN GPTModel cannot even be built there. The fix gives those
modules (:data:`MODULES`) a ``torch`` whose ``cuda.current_device()`` names the host and whose
``cuda.synchronize()`` is a no-op, only when CUDA is unavailable; everything else in them is the real
torch, and GPU runs are untouched.
"""

from __future__ import annotations

import types

import torch

from .gates import megatron_core_in

NEEDED_FOR = ">=0.16, <0.20 (megatron-core), CPU-only hosts"


def is_needed() -> bool:
    return not torch.cuda.is_available() and megatron_core_in("0.16", "0.20")


class _HostCuda(types.SimpleNamespace):
    """torch.cuda, except that the "current device" is the host."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(*_args, **_kwargs) -> None:
        """Host tensors are already there; nothing to wait for."""

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)


class _TorchOnHost(types.ModuleType):
    cuda = _HostCuda()

    def __getattr__(self, name: str):
        return getattr(torch, name)


MODULES = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
)


def apply() -> None:
    import importlib

    host_torch = _TorchOnHost("torch")
    for name in MODULES:
        importlib.import_module(name).torch = host_torch
