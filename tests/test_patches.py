"""Each CPU-host patch in patches/ is needed (upstream fails without it on a CPU host) and works; the
GPU patches' logic runs here on the host (their no-sync evidence is tests/test_patches_gpu.py)."""

from __future__ import annotations

import re

import pytest
import torch
from twinkle_specs.patches import (
    PATCHES,
    apply_all,
    cuda_device_on_host,
    packed_seq_1d,
    rope_on_host,
    router_on_host,
    tied_embedding_on_host,
)
from twinkle_specs.patches.gates import megatron_core_in

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the patches fix CPU-only hosts")
# What upstream raises without a GPU: a CPU build of torch says "not compiled with CUDA enabled", a CUDA
# build on a host without a driver says "Found no NVIDIA driver".
NO_GPU = "CUDA|NVIDIA driver"
ON_HOST = [rope_on_host, router_on_host, tied_embedding_on_host, cuda_device_on_host]


def test_all_host_patches_apply_on_cpu_hosts():
    version_only = [packed_seq_1d] if packed_seq_1d.is_needed() else []
    assert apply_all() == sorted(p.__name__ for p in ON_HOST + version_only)


def test_packed_sequence_bounds_reach_the_model_1d():
    """pretrain_gpt.py (core_v0.16.1) hands get_thd_batch_on_this_cp_rank the collated [1, n] bounds."""
    from megatron.core import utils

    assert packed_seq_1d.is_needed() == megatron_core_in("0.16", "0.17")
    if not hasattr(utils, "get_thd_batch_on_this_cp_rank"):
        pytest.skip("megatron-core 0.19 builds packed batches without get_thd_batch_on_this_cp_rank")
    cu = torch.tensor([[0, 5, 9, 16]], dtype=torch.int32)
    upstream = getattr(
        utils.get_thd_batch_on_this_cp_rank, "__wrapped__", utils.get_thd_batch_on_this_cp_rank
    )
    batch = {"tokens": torch.zeros(1, 16, dtype=torch.long)}
    max_seqlen = torch.tensor([7], dtype=torch.int32)
    _, params = upstream(dict(batch), cu, None, max_seqlen, cp_size=1, cp_rank=0)
    assert params.cu_seqlens_q.shape == (1, 4)  # what TE's THD kernels refuse ("expected 1D tensor")
    _, params = packed_seq_1d.with_1d_bounds(upstream)(dict(batch), cu, cu, max_seqlen, cp_size=1, cp_rank=0)
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_q_padded.tolist() == [0, 5, 9, 16]


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
    with pytest.raises((AssertionError, RuntimeError), match=NO_GPU):
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
    with pytest.raises((AssertionError, RuntimeError), match=NO_GPU):
        upstream(Fake(), x)
    router_mod.Router.gating = router_on_host.gating_on_host


def test_tied_embedding_patch_runs_upstream_on_host_and_restores_tensor_cuda():
    """Upstream calls ``.cuda()``; patched, that is the identity during the call only. The real
    pipeline-parallel tied-embedding case runs in test_parity (qwen2, PP=2)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    class Fake:
        seen = None

    def upstream(self):
        self.seen = torch.ones(1).cuda()

    with pytest.raises((AssertionError, RuntimeError), match=NO_GPU):
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

    with pytest.raises((AssertionError, RuntimeError), match=NO_GPU):
        torch.cuda.current_device()  # what upstream's allocations call
    assert mappings.torch.cuda.current_device() == "cpu" and utils.torch.cuda.current_device() == "cpu"
    assert mappings.torch.empty(2, device=mappings.torch.cuda.current_device()).device.type == "cpu"
    assert mappings.torch.distributed is torch.distributed and torch.cuda.current_device is not None
    assert isinstance(mappings.torch, cuda_device_on_host._TorchOnHost)


def test_gpu_patches_stay_off_on_cpu_hosts():
    gpu_only = [p for p in PATCHES if "on CUDA" in p.NEEDED_FOR]
    assert len(gpu_only) >= 6, [p.__name__ for p in gpu_only]
    assert not any(p.is_needed() for p in gpu_only)


def test_patches_off_env_skips_named_patches_and_rejects_unknown_names(monkeypatch):
    import twinkle_specs.patches as patches

    calls = []
    monkeypatch.setattr(patches, "_applied", set())
    for patch in PATCHES:
        monkeypatch.setattr(patch, "apply", lambda p=patch: calls.append(patches.short_name(p)))
    monkeypatch.setenv(patches.OFF_ENV, " rope_on_host, router_on_host")
    applied = apply_all()
    version_only = ["packed_seq_1d"] if packed_seq_1d.is_needed() else []
    assert calls == ["tied_embedding_on_host", "cuda_device_on_host", *version_only], calls
    assert applied == sorted(f"twinkle_specs.patches.{n}" for n in calls)
    monkeypatch.setenv(patches.OFF_ENV, "rope_on_host,grad_norm")
    with pytest.raises(ValueError, match=r"TWINKLE_PATCHES_OFF.*\['grad_norm'\].*grad_norm_on_device"):
        apply_all()


def _grads(seed: int, scale: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) * scale for shape in [(64, 32), (7,), (3, 5, 11)]]


def _with_grads(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    return params


@pytest.mark.parametrize("scale", [10.0, 1e-3], ids=["clips", "within_max_norm"])
def test_device_grad_norm_clips_as_torch_without_leaving_the_device(megatron_single, scale):
    """The device path (on the host here, through gloo) against torch's clip_grad_norm_, which uses the
    same coefficient min(1, max_norm / (norm + 1e-6)): the norm stays a tensor (no ``.item()``), the
    clipped gradients match to 1e-6 relative, and unclipped ones are untouched bit for bit."""
    from twinkle_specs.patches import grad_norm_on_device as gn

    grads = _grads(0, scale)
    ours, ref = _with_grads(grads), _with_grads(grads)
    norm = gn.get_grad_norm_fp32([p.grad for p in ours])
    assert isinstance(norm, torch.Tensor) and norm.shape == (1,)
    gn.clip_grad_by_total_norm_fp32(ours, 1.0, norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert torch.allclose(norm[0], ref_norm, rtol=1e-6, atol=0)
    for p, r, g in zip(ours, ref, grads, strict=True):
        assert torch.allclose(p.grad, r.grad, rtol=1e-6, atol=1e-12)
        if scale < 1:
            assert torch.equal(p.grad, g)
        else:
            assert p.grad.norm() < g.norm()


def test_device_grad_norm_gives_large_sets_a_host_norm_and_other_norms_to_upstream(
    megatron_single, monkeypatch
):
    """Above DEVICE_CLIP_MAX_NUMEL the 2-norm is still taken here (upstream's fallback without TE's
    multi_tensor_scale_tensor syncs once per gradient), returned as a float as upstream's host path does, and
    clipping goes to upstream's host path; norms other than 2 go to upstream."""
    from megatron.core.optimizer import clip_grads
    from twinkle_specs.patches import grad_norm_on_device as gn

    seen = []
    monkeypatch.setattr(clip_grads, "get_grad_norm_fp32", lambda g, n, grp: seen.append(("norm", n)) or 2.0)
    monkeypatch.setattr(
        clip_grads, "clip_grad_by_total_norm_fp32", lambda p, m, t, d: seen.append(("clip", t))
    )
    grads = _grads(1, 1.0)
    assert gn.get_grad_norm_fp32(grads, norm_type=float("inf")) == 2.0
    monkeypatch.setattr(gn, "DEVICE_CLIP_MAX_NUMEL", sum(g.numel() for g in grads) - 1)
    norm = gn.get_grad_norm_fp32(grads)
    whole = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item()
    assert type(norm) is float and norm == pytest.approx(whole, rel=1e-6)
    gn.clip_grad_by_total_norm_fp32(_with_grads(grads), 1.0, norm)
    assert seen == [("norm", float("inf")), ("clip", norm)]
    # a rank with no gradient still joins the reduction, with a zero
    assert torch.equal(gn.get_grad_norm_fp32([]), torch.zeros(1))


def test_grad_norm_patch_replaces_the_names_megatron_optimizers_call(monkeypatch):
    from megatron.core.optimizer import clip_grads, optimizer
    from twinkle_specs.patches import grad_norm_on_device as gn

    monkeypatch.setattr(optimizer, "get_grad_norm_fp32", optimizer.get_grad_norm_fp32)
    monkeypatch.setattr(optimizer, "clip_grad_by_total_norm_fp32", optimizer.clip_grad_by_total_norm_fp32)
    assert optimizer.get_grad_norm_fp32 is clip_grads.get_grad_norm_fp32  # upstream, on this host
    gn.apply()
    assert optimizer.get_grad_norm_fp32 is gn.get_grad_norm_fp32
    assert optimizer.clip_grad_by_total_norm_fp32 is gn.clip_grad_by_total_norm_fp32


def test_cross_entropy_patch_always_asks_te_for_its_capturable_backward(monkeypatch):
    from megatron.core.models.common.language_module import language_module
    from twinkle_specs.patches import cross_entropy_without_sync as ce

    seen = []

    def upstream(logits, labels, tp_group, is_cg_capturable=False):
        seen.append(is_cg_capturable)
        return "loss"

    monkeypatch.setattr(language_module, "te_parallel_cross_entropy", upstream)
    ce.apply()
    ce.apply()  # idempotent: wraps once
    patched = language_module.te_parallel_cross_entropy
    assert patched.__wrapped__ is upstream
    assert patched("logits", "labels", None, False) == "loss" and patched("l", "t", None) == "loss"
    assert seen == [True, True]


_SHARDED_NORM_WORKER = """
import os, sys
import torch, torch.distributed as dist
from twinkle_specs.patches import grad_norm_on_device as gn

dist.init_process_group("gloo")
rank = dist.get_rank()
gen = torch.Generator().manual_seed(0)
grads = [torch.randn(shape, generator=gen) * 3 for shape in [(64, 32), (7,), (3, 5, 11), (40,)]]
mine = grads[:2] if rank == 0 else grads[2:]  # each rank holds a shard, as the distributed optimizer's do
norm = gn.get_grad_norm_fp32([g.clone() for g in mine])  # reduced over the default group
params = [torch.nn.Parameter(torch.zeros_like(g)) for g in mine]
for p, g in zip(params, mine):
    p.grad = g.clone()
gn.clip_grad_by_total_norm_fp32(params, 1.0, norm)
ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
for p, g in zip(ref, grads):
    p.grad = g.clone()
ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
ref_mine = ref[:2] if rank == 0 else ref[2:]
grad_err = max(((p.grad - r.grad).abs().max() / r.grad.abs().max()).item() for p, r in zip(params, ref_mine))
print(f"rank{rank} norm_rel={abs(norm.item() - ref_norm.item()) / ref_norm.item():.3e} grad_rel={grad_err:.3e}")
# both ranks leave together, and without gloo's teardown: with destroy_process_group() after the barrier, a
# rank still aborted at exit now and then ("terminate called without an active exception", SIGABRT)
sys.stdout.flush()
dist.barrier()
os._exit(0)
"""


def test_device_grad_norm_reduces_over_ranks_holding_shards(tmp_path):
    """Two gloo ranks, each with half of the gradients: the norm is the global one and each rank's clip
    matches torch's clip over all gradients (1e-6 relative)."""
    from conftest import run_dist

    script = tmp_path / "sharded_norm.py"
    script.write_text(_SHARDED_NORM_WORKER)
    out = run_dist(2, script, timeout=240, cpu_only=True).stdout
    number = r"(\d\.\d+e[+-]\d+)"  # the ranks' prints may run together without a newline
    found = re.findall(rf"rank(\d) norm_rel={number} grad_rel={number}", out)
    assert sorted(r for r, _, _ in found) == ["0", "1"], out
    for _, norm_rel, grad_rel in found:
        assert float(norm_rel) <= 1e-6 and float(grad_rel) <= 1e-6, out
