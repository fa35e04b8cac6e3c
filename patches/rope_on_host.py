"""Keep RoPE frequencies on the host when there is no GPU.

Upstream cause: megatron-core 0.16.x-0.19.x ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to
``torch.cuda.current_device()`` on the first forward, unconditionally, so a GPTModel with RoPE cannot run
a forward pass on a CPU-only host (conversion, parity checks, CI), even with ``use_cpu_initialization``.
The fix computes the same embedding on the device ``inv_freq`` already lives on. It is applied only
when CUDA is unavailable, so GPU training runs upstream code unchanged.
"""

from __future__ import annotations

import torch

from .gates import megatron_core_in

NEEDED_FOR = ">=0.16, <0.20 (megatron-core), CPU-only hosts"


def is_needed() -> bool:
    return not torch.cuda.is_available() and megatron_core_in("0.16", "0.20")


def get_emb_on_host(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """Upstream ``RotaryEmbedding.get_emb`` without the move to CUDA."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def apply() -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    RotaryEmbedding.get_emb = get_emb_on_host
