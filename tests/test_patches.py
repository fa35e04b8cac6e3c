"""Each patch in patches/ is needed (upstream fails without it on a CPU host) and works."""

from __future__ import annotations

import pytest
import torch
from twinkle_specs.patches import PATCHES, apply_all, rope_on_host, router_on_host

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the patches fix CPU-only hosts")


def test_all_patches_apply_on_cpu_hosts():
    assert apply_all() == sorted(p.__name__ for p in PATCHES)


def test_rope_needs_and_gets_the_patch():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    assert RotaryEmbedding.get_emb is rope_on_host.get_emb_on_host
    emb = rope.get_emb(5)
    freqs = torch.outer(torch.arange(5, dtype=torch.float32), rope.inv_freq)
    assert torch.allclose(emb[:, 0, 0], torch.cat([freqs, freqs], dim=-1))
    # Upstream behaviour, reproduced: the first call moves inv_freq to CUDA and fails without a GPU.
    import importlib

    import megatron.core.models.common.embeddings.rotary_pos_embedding as rpe

    fresh = importlib.reload(rpe).RotaryEmbedding
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        fresh(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True).get_emb(5)
    rpe.RotaryEmbedding.get_emb = rope_on_host.get_emb_on_host  # leave the reloaded module patched


def test_router_needs_and_gets_the_patch():
    import importlib

    import megatron.core.transformer.moe.router as router_mod

    class Cfg:
        moe_router_dtype = None

    class Fake:
        config = Cfg()
        weight = torch.nn.Parameter(torch.randn(4, 8))
        bias = None

    x = torch.randn(3, 8)
    assert torch.allclose(router_on_host.gating_on_host(Fake(), x), x @ Fake.weight.T)
    upstream = importlib.reload(router_mod).Router.gating
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        upstream(Fake(), x)
    router_mod.Router.gating = router_on_host.gating_on_host


def test_tied_embedding_patch_runs_upstream_on_host_and_restores_tensor_cuda():
    """Upstream calls ``.cuda()``; patched, that is the identity during the call only. The real
    pipeline-parallel tied-embedding case runs in test_parity (qwen2, PP=2)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from twinkle_specs.patches import tied_embedding_on_host

    class Fake:
        seen = None

    def upstream(self):
        self.seen = torch.ones(1).cuda()

    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        upstream(Fake())
    cuda, patched = torch.Tensor.cuda, LanguageModule.setup_embeddings_and_output_layer
    LanguageModule.setup_embeddings_and_output_layer = upstream
    try:
        tied_embedding_on_host.apply()
        fake = Fake()
        LanguageModule.setup_embeddings_and_output_layer(fake)
    finally:
        LanguageModule.setup_embeddings_and_output_layer = patched
    assert fake.seen.device.type == "cpu" and torch.Tensor.cuda is cuda


def test_collectives_allocate_on_host_only_inside_megatron_mappings():
    """The EP=2 / MoE TP=2 layouts in test_parity run through these gathers on gloo."""
    from megatron.core import utils
    from megatron.core.tensor_parallel import mappings
    from twinkle_specs.patches import cuda_device_on_host

    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        torch.cuda.current_device()  # what upstream's allocations call
    assert mappings.torch.cuda.current_device() == "cpu" and utils.torch.cuda.current_device() == "cpu"
    assert mappings.torch.empty(2, device=mappings.torch.cuda.current_device()).device.type == "cpu"
    assert mappings.torch.distributed is torch.distributed and torch.cuda.current_device is not None
    assert isinstance(mappings.torch, cuda_device_on_host._TorchOnHost)
