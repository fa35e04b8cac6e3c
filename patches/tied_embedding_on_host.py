"""Let a pipeline-parallel model with tied embeddings be built on a CPU-only host.

Upstream cause: megatron-core 0.16.x-0.19.x ``LanguageModule.setup_embeddings_and_output_layer`` calls
``weight.data.cuda()`` before all-reducing the shared embedding between the first and last pipeline
stage, so a tied-embedding model with PP > 1 cannot even be constructed without a GPU (conversion, CI).
The fix runs the upstream method with ``Tensor.cuda`` as the identity for the duration of that call, only
when CUDA is unavailable: the all-reduce then runs on the host tensors (gloo).
"""

from __future__ import annotations

import functools

import torch

from .gates import megatron_core_in

NEEDED_FOR = ">=0.16, <0.20 (megatron-core), CPU-only hosts"


def is_needed() -> bool:
    return not torch.cuda.is_available() and megatron_core_in("0.16", "0.20")


def apply() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    upstream = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(upstream)
    def setup_on_host(self) -> None:
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *args, **kwargs: t
        try:
            upstream(self)
        finally:
            torch.Tensor.cuda = cuda

    LanguageModule.setup_embeddings_and_output_layer = setup_on_host
