"""Let tensor/expert-parallel collectives allocate on the host when there is no GPU.

Upstream cause: megatron-core 0.16.x-0.19.x ``tensor_parallel/mappings.py`` allocates the output of its
gathers and reduce-scatters with ``device=torch.cuda.current_device()`` (five places), and so does the
``GlobalMemoryBuffer`` in ``core/utils.py`` that some of them use, so MoE token dispatch (which gathers
along the sequence) and vocab-parallel logit gathers cannot run on a CPU host, even on gloo. The fix
gives those two modules a ``torch`` whose ``cuda.current_device()`` names the host, only when CUDA is
unavailable; everything else in them is the real torch, and GPU runs are untouched.
"""

from __future__ import annotations

import types

import torch
from packaging.version import Version

NEEDED_FOR = ">=0.16, <0.20 (megatron-core), CPU-only hosts"


def is_needed() -> bool:
    import megatron.core

    version = Version(megatron.core.__version__)
    return not torch.cuda.is_available() and Version("0.16") <= version < Version("0.20")


class _HostCuda(types.SimpleNamespace):
    """torch.cuda, except that the "current device" is the host."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)


class _TorchOnHost(types.ModuleType):
    cuda = _HostCuda()

    def __getattr__(self, name: str):
        return getattr(torch, name)


def apply() -> None:
    from megatron.core import utils
    from megatron.core.tensor_parallel import mappings

    mappings.torch = utils.torch = _TorchOnHost("torch")
