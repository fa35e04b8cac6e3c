"""LoRA on the Transformer Engine path (GPU): the TE wrappers (norm-fused QKV/fc1, row/column linears,
grouped-GEMM experts, router) against HF + PEFT, bf16 training with full recompute, merge/unmerge, and
TP=2 with sequence parallelism through megatron's DDP, finalize_model_grads and dist checkpoints.

Tolerances: fp32 runs TE's TF32 GEMMs against PEFT's fp32 eager ops, so logits are held to the limits
measured for the base TE path (max |Δ| 1e-2, 0.25 for MoE routing flips, mean |Δ| 1e-3, cosine >=
0.99999); bf16 logits are judged against the
fp32 truth: mean |Δ| within 1.5x of peft's own bf16 run, and cosine >= 0.999 for dense models. Gradients: max |Δ| <= 1e-2 of the largest gradient. The measured
statistics are written to $TWINKLE_EVIDENCE_DIR/lora-gpu.json when that is set.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import run_dist
from gpu_checks import (
    BF16_ERROR_RATIO,
    BF16_MIN_COSINE,
    FP32_MAX_ABS,
    FP32_MEAN_ABS,
    FP32_MIN_COSINE,
    Evidence,
    fp32_max_abs,
    fp32_router,
)
from test_lora_support import CountingKernel

from twinkle_specs.lora import qk_rope, swiglu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with Transformer Engine"),
]

GRAD_REL = 1e-2
WORKER = Path(__file__).parent / "test_lora_gpu_worker.py"
EVIDENCE = Evidence("lora-gpu.json")


def _peft_adapter(hf: Path, out: Path, **targets):
    """A random PEFT adapter made by peft itself, and its fp32 logits (the truth)."""
    import peft
    from test_lora_support import hf_model, randomize_peft, tokens

    model = peft.get_peft_model(hf_model(hf), peft.LoraConfig(r=8, lora_alpha=16, **targets))
    randomize_peft(model, std=0.05)
    model.save_pretrained(out)
    with torch.no_grad():
        truth = model(tokens(s=64)).logits
        bf16 = model.to(torch.bfloat16)(tokens(s=64)).logits.float()  # peft's own bf16 error, for scale
    return truth, bf16


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def _logits(model, toks: torch.Tensor) -> torch.Tensor:
    from test_lora_support import VOCAB

    toks = toks.cuda()
    pos = torch.arange(toks.shape[1], device="cuda").expand_as(toks)
    with torch.no_grad():
        return model(toks, pos, None)[..., :VOCAB].float().cpu()


CASES = {
    "qwen3-all-linear": ("qwen3", dict(target_modules="all-linear"), {}),
    "qwen3-q-v": ("qwen3", dict(target_modules=["q_proj", "v_proj"]), {}),
    # TE's fused RoPE configured: the q/k norms and RoPE run in lora/qk_rope.py's kernels
    "qwen3-all-linear-rope-fusion": ("qwen3", dict(target_modules="all-linear"), {"apply_rope_fusion": True}),
    "qwen2-partial": ("qwen2", dict(target_modules=["k_proj", "o_proj", "up_proj"]), {}),
    "qwen2_moe-shared": (
        "qwen2_moe",
        dict(target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"]),
        {},
    ),
    # grouped-GEMM experts (TEGroupedLinear) and the router
    "qwen3_moe-grouped-all-linear": (
        "qwen3_moe",
        dict(target_modules="all-linear"),
        {"moe_grouped_gemm": True},
    ),
    "qwen3_moe-sequential-experts": (
        "qwen3_moe",
        dict(
            target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        ),
        {},
    ),
}


@pytest.mark.parametrize("kind,targets,extra", list(CASES.values()), ids=list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_te_lora_matches_peft(kind, targets, extra, dtype, lora_checkpoints, gpu, tmp_path):
    from test_lora_support import tokens

    import twinkle_specs as ts
    from twinkle_specs import LoraConfig

    hf = lora_checkpoints(kind)
    truth, peft_bf16 = _peft_adapter(hf, tmp_path, **targets)
    model = ts.build_model(
        hf,
        lora=LoraConfig.from_peft(tmp_path),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        parallel_output=False,
        **extra,
        **fp32_router(kind, dtype),
    ).eval()
    wrappers = {type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Lora")}
    assert wrappers and all(
        "TE" in w or w in ("LoraTopKRouter", "LoraMLP", "LoraGroupedMLP", "LoraSelfAttention")
        for w in wrappers
    ), wrappers
    before = _logits(model, tokens(s=64))
    ts.load_peft_adapter(model, tmp_path)
    fused_rope = CountingKernel(qk_rope._qk_rope_fwd_kernel)
    qk_rope._qk_rope_fwd_kernel = fused_rope
    try:
        ours = _logits(model, tokens(s=64))
    finally:
        qk_rope._qk_rope_fwd_kernel = fused_rope.kernel
    assert (fused_rope.launches > 0) is bool(extra.get("apply_rope_fusion")), fused_rope.launches
    assert (truth - before).abs().max() > 0.05, "the adapter barely changes the logits: test is vacuous"
    stats = dict(
        max_abs=(ours - truth).abs().max().item(),
        mean_abs=(ours - truth).abs().mean().item(),
        cosine=_cosine(ours, truth),
    )
    if dtype == torch.bfloat16:
        stats |= dict(
            peft_bf16_mean_abs=(peft_bf16 - truth).abs().mean().item(),
            peft_bf16_cosine=_cosine(peft_bf16, truth),
        )
    EVIDENCE.record(f"{kind}-{'-'.join(sorted(str(v) for v in targets.values()))}-{extra}-{dtype}", **stats)
    if dtype == torch.float32:
        assert stats["max_abs"] <= fp32_max_abs(kind), stats
        assert stats["mean_abs"] <= FP32_MEAN_ABS, stats
        assert stats["cosine"] >= FP32_MIN_COSINE, stats
    else:
        # bf16 MoE routing flips move whole tokens, on both sides: judged by peft's own bf16 error.
        assert stats["mean_abs"] <= BF16_ERROR_RATIO * stats["peft_bf16_mean_abs"], stats
        if "moe" not in kind:
            assert stats["cosine"] >= BF16_MIN_COSINE, stats


def test_te_bf16_training_with_full_recompute(lora_checkpoints, gpu):
    from test_lora_support import VOCAB, tokens

    from twinkle_specs import merge_lora, unmerge_lora
    from twinkle_specs.lora import adapter_parameters
    from twinkle_specs.parallel import is_adapter_param

    hf = lora_checkpoints("qwen3")
    model = _bf16_lora_model(
        hf,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    )
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter_param(n)}
    opt = torch.optim.AdamW(adapter_parameters(model), lr=1e-2)
    toks = tokens(s=64).cuda()
    pos = torch.arange(toks.shape[1], device="cuda").expand_as(toks)
    losses = []
    for step in range(15):
        opt.zero_grad()
        logits = model(toks, pos, None)[..., :VOCAB].float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), toks[:, 1:].reshape(-1))
        loss.backward()
        # B starts at zero, so at step 0 only the B factors get a gradient (dL/dA = B^T ... = 0); after
        # one optimizer step every factor must. Zero grads here would mean the recomputed block's
        # backward never ran (its input, the frozen embedding's output, has no grad).
        if step in (0, 1):
            named = [(n, p) for n, p in model.named_parameters() if is_adapter_param(n)]
            zero = [
                n for n, p in named if (step == 1 or "lora_B" in n) and (p.grad is None or not p.grad.any())
            ]
            assert named and not zero, f"step {step}: zero adapter grads under full recompute: {zero[:5]}"
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), f"base weight {n} changed"

    model.eval()
    with_adapter = _logits(model, tokens(s=64))
    merge_lora(model)
    merged = _logits(model, tokens(s=64))
    assert _cosine(merged, with_adapter) >= BF16_MIN_COSINE
    unmerge_lora(model)
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), f"unmerge did not restore {n} exactly"


def test_te_forward_without_autograd_is_the_training_forward_bit_for_bit(lora_checkpoints, gpu):
    """On the TE path with its CUDA kernels (fused SwiGLU, q/k norm + RoPE, norm recipes), a forward
    without autograd gives the training forward's bf16 logits exactly: both take the adapter's scaling
    as the A GEMM's alpha. The scaling 8/6 is not a power of two, so a separate multiply would move
    last bits (the CPU test in test_lora_training.py checks the portable path)."""
    from test_lora_support import randomize_megatron, tokens

    import twinkle_specs as ts
    from twinkle_specs import LoraConfig

    model = ts.build_model(
        lora_checkpoints("qwen3"),
        lora=LoraConfig(r=6, lora_alpha=8, target_modules="all-linear"),
        params_dtype=torch.bfloat16,
        bf16=True,
        bias_activation_fusion=True,
        apply_rope_fusion=True,
    )
    randomize_megatron(model)
    assert model.decoder.layers[0].mlp.lora_fuses_activation  # the SwiGLU kernels are on this path
    toks = tokens(s=64).cuda()
    pos = torch.arange(toks.shape[1], device="cuda").expand_as(toks)
    trained = model(toks, pos, None)
    assert trained.requires_grad
    with torch.no_grad():
        evaluated = model(toks, pos, None)
    assert torch.equal(evaluated, trained.detach()), (evaluated - trained).abs().max()


def _qwen3_moe_lora_bf16(lora_checkpoints, **overrides) -> tuple:
    """Qwen3-MoE with LoRA r=8 all-linear in bf16 on TE grouped-GEMM experts, the adapters randomised
    (B != 0: they change the output and get full gradients), and 64 tokens with their positions."""
    return _randomized_bf16_lora(lora_checkpoints("qwen3_moe"), moe_grouped_gemm=True, **overrides)


def _randomized_bf16_lora(checkpoint, **overrides) -> tuple:
    """:func:`_bf16_lora_model` with its adapters randomised, and 64 tokens with their positions."""
    from test_lora_support import randomize_megatron, tokens

    model = _bf16_lora_model(checkpoint, **overrides)
    randomize_megatron(model)
    toks = tokens(s=64).cuda()
    return model, toks, torch.arange(toks.shape[1], device="cuda").expand_as(toks)


def _bf16_lora_model(checkpoint, **overrides):
    """The model these tests train: LoRA r=8 (alpha 16) on every linear, bf16 parameters and compute."""
    import twinkle_specs as ts
    from twinkle_specs import LoraConfig

    return ts.build_model(
        checkpoint,
        lora=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
        params_dtype=torch.bfloat16,
        bf16=True,
        **overrides,
    )


def _next_token_loss(model, toks: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    from test_lora_support import VOCAB

    logits = model(toks, pos, None)[..., :VOCAB].float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), toks[:, 1:].reshape(-1))


def _loss_and_adapter_grads(model, toks: torch.Tensor, pos: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    """One forward and backward from cleared adapter gradients: the loss and each adapter's gradient (fp32)."""
    from twinkle_specs.lora import adapter_parameters

    for p in adapter_parameters(model):
        p.grad = None
    loss = _next_token_loss(model, toks, pos)
    loss.backward()
    return loss.item(), [p.grad.float().clone() for p in adapter_parameters(model)]


def test_group_ends_reach_the_gpu_without_a_host_sync(gpu):
    """The grouped GEMMs' offsets go to the GPU without the host waiting for the stream (under torch's sync
    debug mode "error" a synchronizing copy raises; the plain copy from pageable memory does), with the
    right values once the stream has run."""
    from twinkle_specs.lora import experts

    experts._LAST_ENDS.clear()
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        busy = busy @ busy  # work queued ahead of the copy
        ends = experts.group_ends([5, 0, 7, 4], torch.device("cuda"))
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.tensor([5, 5, 12, 16], dtype=torch.int32, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ends.tolist() == [5, 5, 12, 16] and ends.dtype == torch.int32


def test_te_frozen_experts_on_grouped_mm_match_te_grouped_linear(lora_checkpoints, gpu, monkeypatch):
    """Qwen3-MoE, LoRA all-linear, TE grouped-GEMM experts in bf16: the frozen experts' base on torch's
    grouped GEMM, with the adapters' products summed into it in place (experts.FrozenGroupedLora), gives
    the loss and adapter gradients of TE's GroupedLinear base with the grouped adapter delta added, and
    it is the path that ran. The two round the adapters' full-size sums differently (once against twice),
    which in bf16 moves the gradients by up to 2.1e-2 of the largest and the loss by 1.3e-4 (measured,
    H200): max |Δ| <= 5e-2 of the largest gradient and the loss within 1e-3 (a lost delta or a block given
    another expert's weights shows as O(1); the op itself is held to fp64 in test_lora_fused.py)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the grouped-GEMM base runs on sm90 (H100/H200) only")
    from twinkle_specs.lora import te_layers

    model, toks, pos = _qwen3_moe_lora_bf16(lora_checkpoints)
    grouped = [m for m in model.modules() if isinstance(m, te_layers._LoraTEGroupedLinear)]
    assert grouped
    loss, grads = _loss_and_adapter_grads(model, toks, pos)
    assert all(hasattr(m, "_grouped_stack") for m in grouped), "the grouped-GEMM base did not run"
    declined: list[int] = []  # TE's GroupedLinear runs wherever the grouped-GEMM base is declined
    monkeypatch.setattr(te_layers._LoraTEGroupedLinear, "_frozen_base_stack", lambda *a: declined.append(1))
    te_loss, te_grads = _loss_and_adapter_grads(model, toks, pos)
    assert len(declined) == len(grouped), "the TE GroupedLinear comparison run did not run TE's base"
    scale = max(g.abs().max().item() for g in te_grads)
    worst = max((g - t).abs().max().item() for g, t in zip(grads, te_grads, strict=True)) / scale
    EVIDENCE.record("frozen_experts_grouped_mm_vs_te", loss=loss, te_loss=te_loss, grad_rel_max=worst)
    assert abs(loss - te_loss) <= 1e-3 * abs(te_loss), (loss, te_loss)
    assert worst <= 5e-2, worst


def test_te_norms_add_the_residual_gradient_bit_for_bit(lora_checkpoints, gpu, monkeypatch):
    """Qwen3, LoRA all-linear, bf16: where megatron takes ``(output, residual)`` from the layer norms
    (megatron-core 0.19+), the hidden norms' backward kernel adds the residual's gradient (norm
    .FrozenRowRMSNorm with ``residual``) and the loss and every adapter gradient are those of the model
    whose norms return their output alone (autograd's own sum), bit for bit: the kernel rounds as that
    sum does. The fused path is checked to have run: each norm backward got the residual's gradient."""
    from twinkle_specs.lora import norm

    model, toks, pos = _randomized_bf16_lora(lora_checkpoints("qwen3"))
    norms = [m for m in model.modules() if isinstance(m, norm.HiddenNorm)]
    assert norms
    if not all(m.returns_residual for m in norms):
        pytest.skip("megatron-core below 0.19 takes no residual from a norm")
    added = []
    backward = norm.FrozenRowRMSNorm.backward

    def counted(ctx, dy, dr=None):
        added.append(dr is not None)
        return backward(ctx, dy, dr)

    monkeypatch.setattr(norm.FrozenRowRMSNorm, "backward", staticmethod(counted))
    loss, grads = _loss_and_adapter_grads(model, toks, pos)
    # every norm whose input needs a gradient (the first layer's may not: frozen embeddings)
    assert len(added) >= len(norms) - 1 and all(added), added
    for m in norms:
        m.returns_residual = False
    calls, added[:] = len(added), []
    plain_loss, plain_grads = _loss_and_adapter_grads(model, toks, pos)
    assert added == [False] * calls, added
    assert loss == plain_loss
    for got, want in zip(grads, plain_grads, strict=True):
        assert torch.equal(got, want)


def test_te_routed_adapters_keep_no_routed_activation(lora_checkpoints, gpu, monkeypatch):
    """Qwen3-MoE, LoRA all-linear, bf16, megatron's all-to-all dispatcher with its fused permute: fc1's
    adapters keep the router's input and rebuild the permuted tokens in backward (recompute
    .RoutedTokens, its bit-for-bit first-use check passes on TE's permute), fc2's input is recomputed
    (megatron's moe_act, mlp.LoraGroupedMLP). Loss and adapter gradients equal those of the adapters
    keeping both inputs, bit for bit, and the forward leaves at least 90 % of those inputs' bytes less
    allocated ([tokens × top-k, hidden + moe_ffn] bf16 per layer)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the adapters' grouped GEMMs run on sm90 (H100/H200) only")
    from twinkle_specs.lora import adapter_parameters
    from twinkle_specs.lora import mlp as lora_mlp
    from twinkle_specs.lora.recompute import RoutedTokens

    model, toks, pos = _qwen3_moe_lora_bf16(
        lora_checkpoints, moe_permute_fusion=True, moe_token_dispatcher_type="alltoall"
    )
    experts = [m for m in model.modules() if isinstance(m, lora_mlp.LoraGroupedMLP)]
    recipes = [e.linear_fc1.lora_input_recipe for e in experts]
    assert experts and all(isinstance(r, RoutedTokens) for r in recipes)

    def step():
        for p in adapter_parameters(model):
            p.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = _next_token_loss(model, toks, pos)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        return loss.item(), [p.grad.clone() for p in adapter_parameters(model)], held

    loss, grads, held = step()
    assert all(r.checked and r.ok for r in recipes), "the routed tokens are not the router input in order"
    assert all(e.activation_recompute for e in experts)
    for e in experts:
        e.linear_fc1.lora_input_recipe = None
    monkeypatch.setattr(lora_mlp, "recompute_allowed", lambda: False)
    plain_loss, plain_grads, plain_held = step()
    assert not any(e.activation_recompute for e in experts)
    config = model.config
    routed = toks.numel() * config.moe_router_topk
    inputs = 2 * routed * (config.hidden_size + config.moe_ffn_hidden_size) * config.num_layers
    EVIDENCE.record(
        "routed_adapters_memory",
        held_bytes=held,
        plain_held_bytes=plain_held,
        adapter_inputs_bytes=inputs,
        loss=loss,
        plain_loss=plain_loss,
    )
    assert loss == plain_loss
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    assert plain_held - held >= 0.9 * inputs, (plain_held, held, inputs)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs with Transformer Engine (TP=2)")
def test_te_tp2_sequence_parallel_matches_peft(lora_checkpoints, tmp_path):
    import peft
    from test_lora_support import VOCAB, hf_model, tokens

    hf = lora_checkpoints("qwen3")
    _peft_adapter(hf, tmp_path / "adapter", target_modules="all-linear")
    run_dist(
        2,
        WORKER,
        "--hf",
        str(hf),
        "--adapter",
        str(tmp_path / "adapter"),
        "--out",
        str(tmp_path),
        timeout=600,
    )

    checks = json.loads((tmp_path / "checks.json").read_text())
    assert checks == {"only_adapters_in_ddp": True, "ckpt_equal": True}
    ref = peft.PeftModel.from_pretrained(hf_model(hf), tmp_path / "adapter", is_trainable=True)
    toks = tokens()
    weights = torch.randn(*toks.shape, VOCAB, generator=torch.Generator().manual_seed(7))
    truth = ref(toks).logits
    (truth * weights).sum().backward()
    ref_grads = {n.replace(".default", ""): p.grad for n, p in ref.named_parameters() if "lora_" in n}
    ours = torch.load(tmp_path / "logits.pt")
    EVIDENCE.record("tp2-sp-logits", max_abs=(ours - truth.detach()).abs().max().item())
    assert (ours - truth.detach()).abs().max().item() <= FP32_MAX_ABS
    grads = torch.load(tmp_path / "grads.pt")
    assert sorted(grads) == sorted(ref_grads)
    scale = max(g.abs().max().item() for g in ref_grads.values())
    worst = max((grads[k].float() - ref_grads[k]).abs().max().item() for k in ref_grads)
    EVIDENCE.record("tp2-sp-grads", max_abs_over_largest=worst / scale)
    assert worst <= GRAD_REL * scale, f"max |Δgrad| {worst} vs largest {scale}"


# FP8 (E4M3 forward, E5M2 gradients: two mantissa bits) against bf16 on the same weights, at the second
# iteration (scales from the first's amaxes): the loss within 0.5 %, the adapter gradients' direction kept
# (cosine over all factors; for the MoE model FP8's error also moves tokens to other experts). Measured on
# an H100 (TE 2.11): loss 6.8e-4 / 1.9e-3 relative, cosine 0.984 / 0.954 (dense / MoE).
FP8_LOSS_RTOL, FP8_GRAD_MIN_COSINE = 5e-3, {"qwen3": 0.975, "qwen3_moe": 0.94}


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_te_fp8_lora_keeps_its_fused_paths(kind, lora_checkpoints, gpu, monkeypatch):
    """LoRA under Megatron's FP8 (``fp8="hybrid"``, delayed scaling: what ``--fp8-format hybrid
    --fp8-recipe delayed`` sets): the frozen base's TE GEMMs take FP8 operands, the adapters stay bf16, and
    the fused LoRA paths run as in bf16 (the q/k norm + RoPE kernel launched, the SwiGLU kernels on). The
    routed experts' frozen base steps aside by its stated rule (torch's grouped GEMM takes no FP8 operands:
    TE's FP8 GroupedLinear runs it, megatron padding each expert's tokens for FP8). Loss and adapter
    gradients against the bf16 run of the same weights."""
    import dataclasses

    from megatron.core.transformer import TransformerConfig
    from test_lora_support import randomize_megatron, tokens
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    from twinkle_specs.lora import adapter_parameters, te_layers

    ok, why = FP8GlobalStateManager.is_fp8_available()
    if not ok:
        pytest.skip(f"no FP8 on this GPU: {why}")
    moe = kind == "qwen3_moe"
    fused = {"bias_activation_fusion": True, "apply_rope_fusion": True} | (
        {"moe_grouped_gemm": True} if moe else {}
    )
    # megatron pads each expert's routed tokens to FP8's GEMM alignment (the field's name by version)
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    pad = next(
        f for f in ("moe_router_padding_for_quantization", "moe_router_padding_for_fp8") if f in fields
    )
    fp8 = {"fp8": "hybrid", "fp8_recipe": "delayed"} | ({pad: True} if moe else {})

    def run(**overrides) -> tuple:
        model = _bf16_lora_model(
            lora_checkpoints(kind),
            **fused,
            **overrides,
        )
        randomize_megatron(model)
        toks = tokens(s=64).cuda()
        pos = torch.arange(64, device="cuda").expand_as(toks)
        # one iteration first, as training has before any step worth comparing: delayed scaling's first
        # quantizations use its initial scale of 1.0, the amaxes they record set the scales used after
        _next_token_loss(model, toks, pos).backward()
        model.zero_grad(set_to_none=True)
        model.set_is_first_microbatch()  # megatron's schedule, at the next iteration's first micro-batch
        loss = _next_token_loss(model, toks, pos)
        loss.backward()
        grads = torch.cat([p.grad.float().flatten() for p in adapter_parameters(model)])
        return model, loss.item(), grads

    _, bf16_loss, bf16_grads = run()
    fused_rope = CountingKernel(qk_rope._qk_rope_fwd_kernel)
    fused_swiglu = CountingKernel(swiglu._fwd_kernel)
    monkeypatch.setattr(qk_rope, "_qk_rope_fwd_kernel", fused_rope)
    monkeypatch.setattr(swiglu, "_fwd_kernel", fused_swiglu)
    model, fp8_loss, fp8_grads = run(**fp8)
    assert model.config.fp8 == "hybrid" and fused_rope.launches > 0
    assert moe or fused_swiglu.launches > 0, "the SwiGLU LoRA kernel did not run under FP8"
    grouped = [m for m in model.modules() if isinstance(m, te_layers._LoraTEGroupedLinear)]
    assert not any(hasattr(m, "_grouped_stack") for m in grouped), "torch's grouped GEMM ran an FP8 base"
    cosine = _cosine(fp8_grads, bf16_grads)
    EVIDENCE.record(f"fp8_vs_bf16_{kind}", fp8_loss=fp8_loss, bf16_loss=bf16_loss, grad_cosine=cosine)
    assert abs(fp8_loss - bf16_loss) <= FP8_LOSS_RTOL * bf16_loss, (fp8_loss, bf16_loss)
    assert cosine >= FP8_GRAD_MIN_COSINE[kind], cosine


def _train_fp8_lora(checkpoint, recipe: str, iterations: int, events: list, **overrides) -> tuple:
    """``(losses, adapter gradients, len(events) per iteration, model)`` of SGD on a LoRA model under
    megatron's FP8 (``fp8="hybrid"``, ``recipe``); ``events`` is emptied before each iteration."""
    from test_lora_support import randomize_megatron, tokens

    from twinkle_specs.lora import adapter_parameters

    model = _bf16_lora_model(
        checkpoint,
        fp8="hybrid",
        fp8_recipe=recipe,
        **overrides,
    )
    randomize_megatron(model)
    opt = torch.optim.SGD(adapter_parameters(model), lr=0.1)
    toks = tokens(s=64).cuda()
    pos = torch.arange(64, device="cuda").expand_as(toks)
    losses, grads, counts = [], [], []
    for _ in range(iterations):
        events.clear()
        model.set_is_first_microbatch()  # megatron's schedule, at each iteration's first micro-batch
        loss = _next_token_loss(model, toks, pos)
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.float().flatten() for p in adapter_parameters(model)]))
        counts.append(len(events))
        opt.step()
        opt.zero_grad()
    return losses, grads, counts, model


def test_te_fp8_frozen_base_is_quantized_once(lora_checkpoints, gpu, monkeypatch):
    """Under FP8 (delayed scaling) the frozen base's weights are quantized by the first two iterations'
    forwards (the first with the recipe's initial scale, the second with the scale of the weight's own
    amax) and TE's FP8 copies are reused by every later iteration (te_layers.FrozenFp8WeightCache), where
    megatron would have TE quantize every weight again at each iteration's start. The losses of 4
    adapter-training iterations equal those of the run that requantizes (a frozen weight's amax, so its
    scale, does not move after that: its FP8 copy is the same; 1e-3 relative for the kernels'
    nondeterminism)."""
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    from twinkle_specs.lora import te_layers

    ok, why = FP8GlobalStateManager.is_fp8_available()
    if not ok:
        pytest.skip(f"no FP8 on this GPU: {why}")
    quantized: list[str] = []
    original = TransformerEngineBaseModule.get_weight_workspace

    def counted(self, *args, **kwargs):
        if kwargs.get("update_workspace", True) and isinstance(self, te_layers.FrozenFp8WeightCache):
            quantized.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TransformerEngineBaseModule, "get_weight_workspace", counted)

    cached, _, cached_counts, _ = _train_fp8_lora(lora_checkpoints("qwen3"), "delayed", 4, quantized)
    monkeypatch.setattr(te_layers.FrozenFp8WeightCache, "_lora_base_stamp", lambda self: None)
    requantized, _, requantized_counts, _ = _train_fp8_lora(
        lora_checkpoints("qwen3"), "delayed", 4, quantized
    )
    EVIDENCE.record(
        "fp8_frozen_base_cache", cached=cached, requantized=requantized, quantizations=cached_counts
    )
    assert cached_counts[0] > 0 and cached_counts[1:] == [cached_counts[0], 0, 0], cached_counts
    assert requantized_counts == [cached_counts[0]] * 4, requantized_counts
    assert cached[-1] < cached[0], cached  # the adapters trained
    for a, b in zip(cached, requantized, strict=True):
        assert abs(a - b) <= 1e-3 * abs(b), (cached, requantized)


def test_te_fp8_known_amax_cast_is_te_current_scaling(gpu):
    """fp8_amax's cast (TE's scale computed from the SwiGLU kernel's partial maxima; our cast kernel for a
    contiguous tensor, TE's cast with the scale given for a strided one) against TE's own current-scaling
    quantizer on the same tensor: the FP8 bytes and the inverse scale bit for bit, E4M3 and E5M2, with and
    without power-of-two scales and an amax epsilon."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    from twinkle_specs.lora import fp8_amax

    ok, why = FP8GlobalStateManager.is_fp8_available()
    if not ok:
        pytest.skip(f"no FP8 on this GPU: {why}")
    g = torch.Generator(device="cuda").manual_seed(0)
    pre = torch.randn(512, 2 * 1536, device="cuda", generator=g).mul(2).to(torch.bfloat16)
    h = torch.randn(512, 16, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(2 * 1536, 16, device="cuda", generator=g).mul(0.1).to(torch.bfloat16)
    out, partials = swiglu._triton_forward(pre, h, b, amax=True)
    compared = 0
    for fp8_dtype in (tex.DType.kFloat8E4M3, tex.DType.kFloat8E5M2):
        for pow2, eps in ((False, 0.0), (True, 0.0), (False, 1e3)):  # 1e3: the epsilon floor decides
            te = Float8CurrentScalingQuantizer(
                fp8_dtype,
                out.device,
                rowwise=True,
                columnwise=False,
                force_pow_2_scales=pow2,
                amax_epsilon=eps,
            )
            for x in (out, out.t()):  # contiguous: our cast kernel; strided: TE's cast with the scale given
                want = te(x)
                got = fp8_amax.KnownAmaxCast(te)(x, partials)
                assert torch.equal(got._scale_inv, want._scale_inv), (fp8_dtype, pow2, eps, x.stride())
                assert torch.equal(got._data, want._data), (fp8_dtype, pow2, eps, x.stride())
                assert got.shape == x.shape and torch.equal(got.dequantize(), want.dequantize())
                compared += 1
    assert compared == 12


def test_te_fp8_lora_kernel_amax_trains_as_te_current_scaling(lora_checkpoints, gpu, monkeypatch):
    """The kernels' amax (on by default) under FP8 current scaling (``--fp8-recipe tensorwise``): the casts
    are counted per tensor (FP8 format, width). From the first iteration on fc1's output gradient (SwiGLU's
    backward); from the second, once the linears have set up their quantizers, also QKV's output gradient
    (the q/k norm + RoPE backward), QKV's and fc1's inputs (HiddenNorm) and fc2's input (SwiGLU's forward):
    one each per layer. 3 training iterations' losses and adapter gradients equal those of TE taking every
    amax itself (``TWINKLE_FP8_KERNEL_AMAX=0``; 1e-3 relative: the two runs' own nondeterminism; the casts
    are the same)."""
    import collections

    import transformer_engine_torch as tex
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    from twinkle_specs.lora import fp8_amax

    ok, why = FP8GlobalStateManager.is_fp8_available()
    if not ok:
        pytest.skip(f"no FP8 on this GPU: {why}")
    casts: list[tuple] = []
    real = fp8_amax.KnownAmaxCast.__call__

    def counted(self, x, partials):
        casts.append(("e4m3" if self.like.dtype == tex.DType.kFloat8E4M3 else "e5m2", x.shape[-1]))
        return real(self, x, partials)

    monkeypatch.setattr(fp8_amax.KnownAmaxCast, "__call__", counted)

    def train() -> tuple:
        return _train_fp8_lora(
            lora_checkpoints("qwen3"),
            "tensorwise",
            3,
            casts,
            bias_activation_fusion=True,
            apply_rope_fusion=True,
        )

    monkeypatch.setenv(fp8_amax.ENV, "0")
    te_losses, te_grads, te_counts, model = train()
    monkeypatch.delenv(fp8_amax.ENV)
    losses, grads, counts, _ = train()
    c, layers = model.config, model.config.num_layers
    qkv = (c.num_attention_heads + 2 * c.num_query_groups) * c.kv_channels
    want = collections.Counter()  # summed: two tensors may have one width (fc1's gradient and QKV's here)
    want[("e5m2", 2 * c.ffn_hidden_size)] += layers  # fc1's output gradient
    want[("e5m2", qkv)] += layers  # QKV's output gradient
    want[("e4m3", c.hidden_size)] += 2 * layers  # QKV's and fc1's inputs
    want[("e4m3", c.ffn_hidden_size)] += layers  # fc2's input
    want, last = dict(want), dict(collections.Counter(casts))  # the last iteration's
    EVIDENCE.record("fp8_kernel_amax", losses=losses, te_losses=te_losses, casts=counts, last=str(last))
    assert te_counts == [0, 0, 0] and counts == [layers, 5 * layers, 5 * layers], (te_counts, counts)
    assert last == want, (last, want)
    assert losses[-1] < losses[0], losses  # the adapters trained
    for ours, theirs in zip(losses, te_losses, strict=True):
        assert abs(ours - theirs) <= 1e-3 * abs(theirs), (losses, te_losses)
    for ours, theirs in zip(grads, te_grads, strict=True):
        assert (ours - theirs).abs().max() <= 1e-3 * theirs.abs().max(), (ours - theirs).abs().max()
