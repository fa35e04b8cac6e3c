"""The GPU patches on a GPU (patches/grad_norm_on_device.py, patches/cross_entropy_without_sync.py).

A LoRA training step (forward with TE's fused cross entropy, backward, megatron DDP and its distributed
optimizer with clipping) runs under torch's sync debug mode, which reports every host sync with the
Python line that made it. Upstream makes two per step, at the gradient norm's ``.item()`` and at TE's
``torch.tensor(1.0, device=...)``; patched it makes none. Both runs train the same model on the same data:
their gradient norms and Adam's first moments (the clipped gradients' mean) agree to 1e-5 relative, their
losses to 1e-3 and their adapters to 2 bf16 steps.
Measured values go to $TWINKLE_EVIDENCE_DIR/patches-gpu.json.
"""

from __future__ import annotations

import gc
import traceback
import warnings

import pytest
import torch
from gpu_checks import Evidence
from twinkle_specs.patches.gates import megatron_core_in

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with Transformer Engine"),
]

EVIDENCE = Evidence("patches-gpu.json")


def _upstream(monkeypatch) -> None:
    """Megatron's own functions back in the places the patches replace."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.models.common.language_module import language_module
    from megatron.core.optimizer import clip_grads, optimizer

    monkeypatch.setattr(optimizer, "get_grad_norm_fp32", clip_grads.get_grad_norm_fp32)
    monkeypatch.setattr(optimizer, "clip_grad_by_total_norm_fp32", clip_grads.clip_grad_by_total_norm_fp32)
    monkeypatch.setattr(language_module, "te_parallel_cross_entropy", te_ext.te_parallel_cross_entropy)


def _upstream_moe(monkeypatch) -> None:
    """Megatron's own MoE dispatch back (before a model is built: the sort's orders are marked at the
    dispatcher's construction)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    monkeypatch.setattr(token_dispatcher, "sort_chunks_by_idxs", moe_utils.sort_chunks_by_idxs)
    for name in ("__init__", "_maybe_dtoh_and_synchronize"):
        monkeypatch.setattr(dispatcher, name, getattr(dispatcher, name).__wrapped__)
    if getattr(token_dispatcher.permute, "fixed_size", False):  # moe_permute_fixed_size (0.16.x)
        monkeypatch.setattr(token_dispatcher, "permute", token_dispatcher.permute.__wrapped__)


def _lora_training(hf, clip_grad: float, targets: str | list[str] = "all-linear", **overrides):
    """A bf16 LoRA model under megatron DDP and the distributed optimizer (as the benchmark runs it);
    returns ``step() -> (loss, grad_norm)``, the model and the optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from test_lora_support import tokens

    import twinkle_specs as ts
    from twinkle_specs import LoraConfig

    torch.manual_seed(0)
    torch.cuda.manual_seed(0)
    bf16 = torch.bfloat16
    model = ts.build_model(
        hf,
        lora=LoraConfig(r=8, lora_alpha=16, target_modules=targets),
        params_dtype=bf16,
        bf16=True,
        cross_entropy_loss_fusion=True,
        cross_entropy_fusion_impl="te",
        **overrides,
    )
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
        module=model,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            bf16=True,
            params_dtype=bf16,
            use_distributed_optimizer=True,
            clip_grad=clip_grad,
        ),
        [ddp],
    )
    data = tokens(s=65).cuda()
    toks, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    pos = torch.arange(toks.shape[1], device="cuda").expand_as(toks)

    def step():
        loss = ddp(toks, pos, None, labels=labels).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        _, grad_norm, _ = opt.step()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        return loss.detach(), grad_norm

    return step, model, opt


def _first_moments(opt) -> torch.Tensor:
    """Adam's first moments, all shards in one vector: the clipped gradients' running mean. (The
    parameters cannot show a clip: Adam's update does not change when every gradient is scaled.)"""
    inner = opt.chained_optimizers[0].optimizer
    moments = [inner.get_unscaled_state(p, "exp_avg") for g in inner.param_groups for p in g["params"]]
    return torch.cat([m.detach().float().flatten() for m in moments])


def _syncs(fn) -> list[str]:
    """Every host sync ``fn`` makes (torch's sync debug mode warns at each), as the three innermost
    ``file:line`` outside torch that led to it, innermost first."""
    found = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing CUDA operation" in str(message):  # not the mode's own notice
            stack = traceback.extract_stack()[:-1]
            outside = [
                f for f in stack if "/torch/" not in f.filename and not f.filename.endswith("warnings.py")
            ]
            where = [f"{f.filename}:{f.lineno}" for f in reversed(outside[-3:])] or [f"{filename}:{lineno}"]
            found.append(" < ".join(where))

    # Python's GC off, as pretrain_gpt.py's --manual-gc and the benchmark have it: a collection would run
    # other objects' finalizers inside the step
    gc.collect()
    torch.cuda.synchronize()
    gc.disable()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            gc.enable()
    return found


@pytest.mark.parametrize("clip_grad", [1e-3, 1e9], ids=["clipping", "not_clipping"])
def test_lora_step_makes_no_host_sync_and_trains_as_upstream(lora_checkpoints, gpu, monkeypatch, clip_grad):
    from megatron.core.models.common.language_module import language_module
    from megatron.core.optimizer import optimizer
    from twinkle_specs.patches import grad_norm_on_device

    assert optimizer.get_grad_norm_fp32 is grad_norm_on_device.get_grad_norm_fp32, "patch not in force"
    assert getattr(language_module.te_parallel_cross_entropy, "without_sync", False), "patch not in force"
    hf = lora_checkpoints("qwen3")
    runs = {}
    for name in ("patched", "upstream"):
        with monkeypatch.context() as m:
            if name == "upstream":
                _upstream(m)
            step, model, opt = _lora_training(hf, clip_grad)
            out = [step() for _ in range(3)]  # warm: allocator, Triton and TE kernels compiled
            syncs = _syncs(lambda: out.append(step()))  # noqa: B023 (called at once)
            out.append(step())
            losses = [float(loss) for loss, _ in out]
            norms = [float(n) for _, n in out]
            adapters = {n: p.detach().float().clone() for n, p in model.named_parameters() if "lora" in n}
            moments = _first_moments(opt)
        runs[name] = {"syncs": syncs, "losses": losses, "norms": norms, "adapters": adapters, "m": moments}
    patched, upstream = runs["patched"], runs["upstream"]
    assert patched["syncs"] == [], f"host syncs with the patches: {patched['syncs']}"
    upstream_files = {s.split(" < ")[0].rsplit(":", 1)[0].rsplit("/", 1)[-1] for s in upstream["syncs"]}
    assert {"clip_grads.py", "cross_entropy.py"} <= upstream_files, upstream["syncs"]

    norm_rel = max(abs(a - b) / b for a, b in zip(patched["norms"], upstream["norms"], strict=True))
    loss_rel = max(abs(a - b) / b for a, b in zip(patched["losses"], upstream["losses"], strict=True))
    # in bf16 steps at each adapter tensor's largest value
    adapter_steps = max(
        ((patched["adapters"][n] - u).abs().max() / (u.abs().max() * 2**-8)).item()
        for n, u in upstream["adapters"].items()
    )
    moment_rel = ((patched["m"] - upstream["m"]).abs().max() / upstream["m"].abs().max()).item()
    clipped = all(n > clip_grad for n in upstream["norms"])
    EVIDENCE.record(
        f"lora_step_{'clipping' if clip_grad < 1 else 'not_clipping'}",
        upstream_syncs=upstream["syncs"],
        patched_syncs=patched["syncs"],
        grad_norm_max_rel=norm_rel,
        loss_max_rel=loss_rel,
        adapter_max_bf16_steps=adapter_steps,
        adam_first_moment_max_rel=moment_rel,
        adam_first_moment_max=upstream["m"].abs().max().item(),
        clipped_every_step=clipped,
        norms=upstream["norms"],
    )
    assert clipped == (clip_grad < 1), upstream["norms"]
    assert norm_rel <= 1e-5, (patched["norms"], upstream["norms"])
    assert moment_rel <= 1e-5, moment_rel  # a missed clip (x 1e-3) or a double one would be far off
    assert loss_rel <= 1e-3, (patched["losses"], upstream["losses"])
    assert adapter_steps <= 2, adapter_steps


def _syncs_and_event_waits(fn) -> tuple[list[str], int]:
    """:func:`_syncs` of ``fn``, and how many times it waited on a CUDA event (``Event.synchronize``, which
    the sync debug mode does not report)."""
    waits, real = [], torch.cuda.Event.synchronize

    def counted(event):
        waits.append(1)
        return real(event)

    torch.cuda.Event.synchronize = counted
    try:
        return _syncs(fn), len(waits)
    finally:
        torch.cuda.Event.synchronize = real


MOE_STEPS = {
    "adapted": ("all-linear", True),
    "frozen_experts": (["q_proj", "k_proj", "v_proj", "o_proj"], True),
    "unfused_permute": ("all-linear", False),
}


@pytest.mark.parametrize("case", list(MOE_STEPS))
def test_moe_lora_step_makes_no_host_sync_and_trains_as_upstream(lora_checkpoints, gpu, monkeypatch, case):
    """Qwen3-MoE, LoRA in bf16 on all linears or on attention only (the routed experts frozen), the routed
    experts on torch's grouped GEMM (sm90), megatron's all-to-all dispatcher with TE's fused permutation,
    as the benchmark runs it, or with megatron's own (unfused) permutation. Patched
    (moe_single_rank_sort, moe_counts_on_device, and on 0.16.x moe_permute_fixed_size), a training step
    makes no host sync: none under the sync debug mode and no CUDA event waited on; upstream waits on the
    counts' copy (an event) in every MoE layer's forward and sorts the tokens by the identity, and on 0.16.x
    its unfused permutation reads the routed tokens' count back (a sync). Losses, gradient norms and
    adapters as in the dense test's bounds."""
    targets, fused = MOE_STEPS[case]
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the experts take their counts on the device through torch's grouped GEMM: sm90 only")
    from megatron.core.transformer.moe import token_dispatcher

    assert getattr(token_dispatcher.sort_chunks_by_idxs, "skips_identity", False), "patch not in force"
    hf = lora_checkpoints("qwen3_moe")
    moe = dict(moe_grouped_gemm=True, moe_permute_fusion=fused, moe_token_dispatcher_type="alltoall")
    runs = {}
    for name in ("patched", "upstream"):
        with monkeypatch.context() as m:
            if name == "upstream":
                _upstream_moe(m)
            step, model, _ = _lora_training(hf, 1e9, targets, **moe)
            layers = [mod for mod in model.modules() if hasattr(mod, "token_dispatcher")]
            out = [step() for _ in range(3)]
            syncs, waits = _syncs_and_event_waits(lambda: out.append(step()))  # noqa: B023 (called at once)
            out.append(step())
            adapters = {n: p.detach().float().clone() for n, p in model.named_parameters() if "lora" in n}
        runs[name] = {
            "syncs": syncs,
            "waits": waits,
            "losses": [float(loss) for loss, _ in out],
            "norms": [float(n) for _, n in out],
            "adapters": adapters,
            "moe_layers": len(layers),
            "counts_on_device": [
                bool(getattr(x.token_dispatcher, "counts_on_device", False)) for x in layers
            ],
        }
    patched, upstream = runs["patched"], runs["upstream"]
    loss_rel = max(abs(a - b) / b for a, b in zip(patched["losses"], upstream["losses"], strict=True))
    norm_rel = max(abs(a - b) / b for a, b in zip(patched["norms"], upstream["norms"], strict=True))
    adapter_steps = max(
        ((patched["adapters"][n] - u).abs().max() / (u.abs().max() * 2**-8)).item()
        for n, u in upstream["adapters"].items()
    )
    EVIDENCE.record(
        f"moe_lora_step_{case}",
        moe_layers=patched["moe_layers"],
        upstream_syncs=upstream["syncs"],
        upstream_event_waits=upstream["waits"],
        patched_syncs=patched["syncs"],
        patched_event_waits=patched["waits"],
        loss_max_rel=loss_rel,
        grad_norm_max_rel=norm_rel,
        adapter_max_bf16_steps=adapter_steps,
        losses=patched["losses"],
    )
    assert all(patched["counts_on_device"]) and patched["moe_layers"], patched["counts_on_device"]
    assert patched["syncs"] == [] and patched["waits"] == 0, (patched["syncs"], patched["waits"])
    assert upstream["waits"] >= upstream["moe_layers"], upstream["waits"]
    if not fused and megatron_core_in("0.16", "0.17"):  # masked_select's size read back in every MoE layer
        assert len(upstream["syncs"]) >= upstream["moe_layers"], upstream["syncs"]
    assert loss_rel <= 1e-3, (patched["losses"], upstream["losses"])
    assert norm_rel <= 1e-5, (patched["norms"], upstream["norms"])
    assert adapter_steps <= 2, adapter_steps
