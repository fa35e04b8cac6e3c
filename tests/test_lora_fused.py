"""The fused adapter computation (one A GEMM, one communication, one block-structured B GEMM per
linear; grouped GEMM for routed experts; RMSNorm in the input dtype) against the plain per-slot
reference it replaced, on CPU in fp32 (portable layers in-process, TP=2 on gloo ranks, TE wrappers over
the stand-ins of test_lora_te_standin.py), and the CUDA grouped GEMM in bf16 (GPU-marked).

Tolerances: fp32, same products summed in another order and ``scaling`` applied to the rank-r
activation instead of the output, so values agree to a few fp32 ulps: max |Δ| <= 1e-5 relative to the
largest value compared (measured on torch 2.13 CPU, outputs and gradients: <= 2.6e-7 at TP=1,
<= 1.5e-7 at TP=2 with and without sequence parallelism, <= 1.6e-7 grouped GEMM vs loop).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dist_jobs import DistJobs
from test_lora_support import randomize_layer, single_rank  # noqa: F401  (fixture)
from test_lora_te_standin import te  # noqa: F401  (fixture)

from twinkle_specs.lora import experts, layers
from twinkle_specs.lora.config import SlotSpec

REL_TOL = 1e-5
WORKER = Path(__file__).parent / "test_lora_fused_worker.py"
S = SlotSpec

CASES = {
    # site, slots, (input size, output size) of the base linear
    "qkv-full": ("linear_qkv", dict(q_proj=S(4, 8, False), k_proj=S(4, 8, False), v_proj=S(4, 8, False))),
    "qkv-q-v": ("linear_qkv", dict(q_proj=S(4, 8, False), v_proj=S(4, 8, False))),
    "qkv-k-only": ("linear_qkv", dict(k_proj=S(4, 16, False))),
    # rank_pattern / alpha_pattern / rsLoRA: other ranks and scalings per slot
    "qkv-ranks": ("linear_qkv", dict(q_proj=S(8, 16, False), k_proj=S(2, 8, True), v_proj=S(5, 3, False))),
    "fc1-full": ("linear_fc1", dict(gate_proj=S(4, 8, False), up_proj=S(4, 8, False))),
    "fc1-up-only": ("linear_fc1", dict(up_proj=S(4, 8, False))),
    "fc1-ranks": ("linear_fc1", dict(gate_proj=S(2, 4, False), up_proj=S(6, 6, True))),
    "proj-row": ("linear_proj", dict(o_proj=S(4, 8, False))),
    "fc2-row-scaling-1": ("linear_fc2", dict(down_proj=S(4, 4, False))),
}
SIZES = {"linear_qkv": (32, 128), "linear_fc1": (32, 96), "linear_proj": (64, 32), "linear_fc2": (48, 32)}


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    # GQA: 8 query heads in 4 groups of head_dim 8 -> linear_qkv rows [q 64 | k 32 | v 32] per 4 groups
    base = dict(num_layers=1, hidden_size=32, num_attention_heads=8, num_query_groups=4, kv_channels=8)
    return TransformerConfig(**base, use_cpu_initialization=True, **kw)


def _portable(site: str, slots: dict, dropout: float = 0.0, config=None):
    config = config or _config()
    cls = (
        layers.LoraRowParallelLinear
        if site in ("linear_proj", "linear_fc2")
        else layers.LoraColumnParallelLinear
    )
    kw = dict(input_is_parallel=True) if cls is layers.LoraRowParallelLinear else dict(gather_output=False)
    n_in, n_out = SIZES[site]
    layer = cls(
        n_in,
        n_out,
        config=config,
        init_method=torch.nn.init.normal_,
        bias=False,
        skip_bias_add=True,
        lora_site=site,
        lora_slots=slots,
        lora_dropout=dropout,
        **kw,
    )
    randomize_layer(layer)
    return layer


def _factors(layer) -> list[torch.Tensor]:
    return [layer.lora_A, layer.lora_B]


def _run(layer, fn, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """fn(x) and the gradients of <fn(x), grad> with respect to x and every factor."""
    x = x.detach().clone().requires_grad_(True)
    for p in _factors(layer):
        p.grad = None
    y = fn(x)
    (y * grad).sum().backward()
    return [y.detach(), x.grad, *(p.grad for p in _factors(layer))]


def _rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest |Δ| over all tensors, relative to the largest |value| of the reference."""
    scale = max(w.abs().max().item() for w in want)
    assert scale > 0
    return max((g - w).abs().max().item() for g, w in zip(got, want, strict=True)) / scale


@pytest.mark.parametrize("site,slots", list(CASES.values()), ids=list(CASES))
def test_fused_equals_per_slot_reference(site, slots, single_rank):  # noqa: F811
    layer = _portable(site, slots)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2, SIZES[site][0], generator=g)
    grad = torch.randn(6, 2, SIZES[site][1], generator=g)
    fused = _run(layer, layer.lora_delta, x, grad)
    ref = _run(layer, layer.lora_delta_per_slot, x, grad)
    assert _rel(fused, ref) <= REL_TOL
    assert fused[0].abs().max() > 0.1  # a real delta, and every factor got a real gradient
    assert all(t.abs().max() > 0 for t in fused[1:])
    b_grad = fused[-1]
    for slot in slots:  # ... and B columns a smaller rank leaves unused get none: they stay zero
        rows = layer.lora_factor_index("B", slot)[1]
        assert torch.equal(b_grad[rows, slots[slot].r :], torch.zeros_like(b_grad[rows, slots[slot].r :]))
    # The layer's own forward adds the fused delta to the base output.
    out, _ = layer(x)
    base = F.linear(x, layer.weight)
    assert (out - base - ref[0]).abs().max().item() <= REL_TOL * ref[0].abs().max().item()


def test_fused_b_layout(single_rank):  # noqa: F811
    """The fused B: each slot's B in its own column block and its own output rows (QKV interleaved per
    query group), exact zeros elsewhere; one layout object shared by layers of the same shape."""
    slots = dict(q_proj=S(3, 8, False), v_proj=S(2, 8, False))
    layer = _portable("linear_qkv", slots)
    b = layer.lora_B_fused()
    assert b.shape == (128, 5)
    assert layer.lora_B.shape == (96, 3)  # [q rows; v rows], as wide as the largest rank
    q, v = layer.lora_factor("B", "q_proj"), layer.lora_factor("B", "v_proj")
    assert torch.equal(v, layer.lora_B[64:, :2])
    groups = b.view(4, 32, 5)  # per query group: 16 q rows, 8 k rows, 8 v rows
    assert torch.equal(groups[:, :16, :3], q.reshape(4, 16, 3))
    assert torch.equal(groups[:, 24:, 3:], v.reshape(4, 8, 2))
    mask = torch.ones(4, 32, 5, dtype=torch.bool)
    mask[:, :16, :3] = False
    mask[:, 24:, 3:] = False
    assert torch.equal(groups[mask], torch.zeros(int(mask.sum())))
    other = _portable("linear_qkv", slots)
    assert layers._fused_b_layout(other._lora_b_key(), torch.device("cpu")) is layers._fused_b_layout(
        layer._lora_b_key(), torch.device("cpu")
    )


def test_dropout_keeps_a_mask_per_slot(single_rank):  # noqa: F811
    """With dropout each slot draws its own mask (PEFT's separate modules), in slot order: the fused
    forward equals the reference under the same RNG state; in eval mode there is no dropout at all."""
    slots = dict(q_proj=S(4, 8, False), k_proj=S(2, 8, False), v_proj=S(4, 8, False))
    layer = _portable("linear_qkv", slots, dropout=0.3)
    x = torch.randn(6, 2, 32)
    grad = torch.randn(6, 2, 128)
    torch.manual_seed(7)
    fused = _run(layer, layer.lora_delta, x, grad)
    torch.manual_seed(7)
    ref = _run(layer, layer.lora_delta_per_slot, x, grad)
    assert _rel(fused, ref) <= REL_TOL
    layer.eval()
    no_dropout = _portable("linear_qkv", slots)
    assert isinstance(no_dropout.lora_dropout, torch.nn.Identity)
    with torch.no_grad():
        assert _rel([layer.lora_delta(x)], [no_dropout.lora_delta(x)]) <= REL_TOL


@pytest.fixture(scope="module")
def tp2_jobs(tmp_path_factory, request):
    """Both TP=2 runs of the worker in one torchrun launch (tests/dist_jobs.py)."""
    jobs = DistJobs(WORKER, tmp_path_factory.mktemp("fused-tp2"), request, timeout=240, cpu_only=True)
    for sp, name in ((False, "tp2"), (True, "tp2-sp")):
        args = ["--sp"] if sp else []
        jobs.add(name, 2, lambda out, args=args: ["--out", str(out), *args], test=f"{TP2_TEST}[{name}]")
    return jobs


TP2_TEST = "test_fused_equals_per_slot_at_tp2"


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_fused_equals_per_slot_at_tp2(sp, tp2_jobs, request):
    """TP=2 (gloo): QKV with GQA (2 query groups per rank), fc1 and the row-parallel linears, full and
    partial targets, different ranks; with sequence parallelism the rank-r activation is all-gathered
    (column) or reduce-scattered (row) once for all slots."""
    out = tp2_jobs.out(request.node.callspec.id)
    worst = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(len(w) == (5 if sp else 10) for w in worst), worst
    assert max(v for w in worst for v in w.values()) <= REL_TOL, worst


# -- routed experts (TE grouped linear over stand-ins) -------------------------------------------------

SPLITS = [3, 0, 5, 0, 1, 0]  # zero-token experts in the middle and at the end


def _experts(te, site="experts.linear_fc1", n_in=32, n_out=24, r=4):  # noqa: F811
    cls = te.LoraTEColumnParallelGroupedLinear if site.endswith("fc1") else te.LoraTERowParallelGroupedLinear
    layer = cls(
        len(SPLITS),
        n_in,
        n_out,
        config=_config(),
        is_expert=True,
        lora_site=site,
        lora_slots={layers.SITE_SLOTS[site][0]: S(r, 2 * r + 1, False)},
        lora_dropout=0.0,
    )
    randomize_layer(layer)
    return layer


@pytest.mark.parametrize("site", ["experts.linear_fc1", "experts.linear_fc2"])
def test_grouped_experts_grouped_mm_equals_loop(te, site, single_rank, monkeypatch):  # noqa: F811
    """torch's grouped GEMM (forced here: on CPU it runs torch's own fallback kernel) equals the
    per-expert loop, zero-token experts included (zero gradients for them)."""
    layer = _experts(te, site)
    assert not experts.grouped_mm_fits(torch.randn(9, 32), SPLITS, layer.lora_A, layer.lora_B)
    x = torch.randn(sum(SPLITS), 32)
    grad = torch.randn(sum(SPLITS), 24)

    def forward(x):
        return layer(x, SPLITS)[0]

    monkeypatch.setattr(te, "grouped_mm_fits", lambda *a: False)
    loop = _run(layer, forward, x, grad)
    monkeypatch.setattr(te, "grouped_mm_fits", lambda *a: True)
    grouped = _run(layer, forward, x, grad)
    assert _rel(grouped, loop) <= REL_TOL
    (slot,) = layer.lora_slots
    for p in (layer.lora_A, layer.lora_B):
        assert torch.equal(p.grad[[1, 3, 5]], torch.zeros_like(p.grad[[1, 3, 5]]))
        assert all(p.grad[e].abs().max() > 0 for e in (0, 2, 4))
    # The loop is the former per-expert math: scaling * B_e(A_e(x_e)).
    a, b, s = layer.lora_A, layer.lora_B, layer.lora_spec[slot].scaling
    blocks = torch.split(x, SPLITS)
    want = torch.cat([F.linear(F.linear(xe, a[e]), b[e]) * s for e, xe in enumerate(blocks)])
    assert torch.equal(experts.expert_delta_loop(x, a, b, SPLITS, s), want)


def test_grouped_experts_without_tokens(te, single_rank):  # noqa: F811
    """No token for any local expert: the loop runs (no grouped GEMM over nothing) and the factors
    still get (zero) gradients, so every rank's DDP buckets see them."""
    layer = _experts(te)
    x = torch.randn(0, 32, requires_grad=True)
    out, _ = layer(x, [0] * len(SPLITS))
    out.sum().backward()
    assert out.shape == (0, 24)
    assert all(p.grad is not None and not p.grad.any() for p in _factors(layer))


@pytest.mark.parametrize("site", ["experts.linear_fc1", "experts.linear_fc2"])
def test_frozen_experts_base_runs_as_one_grouped_gemm(te, site, single_rank, monkeypatch):  # noqa: F811
    """With frozen expert weights and torch's grouped GEMM available (forced here: CPU runs torch's own
    kernel), the base is one grouped GEMM over views of one weight stack: same output and gradients as
    the stand-in's per-expert GEMMs, zero-token experts included; the parameters keep their values and
    names; a weight given new storage afterwards is read at its new value, not from the old stack."""
    layer = _experts(te, site)
    for _, w in layer.lora_base_weights():
        w.requires_grad_(False)
    before = {n: t.clone() for n, t in layer.state_dict().items()}
    x = torch.randn(sum(SPLITS), 32)
    grad = torch.randn(sum(SPLITS), 24)

    def forward(x):
        return layer(x, SPLITS)[0]

    monkeypatch.setattr(te, "grouped_mm_fits", lambda *a: False)
    per_expert = _run(layer, forward, x, grad)
    assert not hasattr(layer, "_grouped_stack")  # the stand-in (TE) base ran
    monkeypatch.setattr(te, "grouped_mm_fits", lambda *a: True)
    grouped = _run(layer, forward, x, grad)
    assert _rel(grouped, per_expert) <= REL_TOL
    stack = layer._grouped_stack.get([w for _, w in layer.lora_base_weights()])
    assert stack.shape == (len(SPLITS), 24, 32)
    for e, (_, w) in enumerate(layer.lora_base_weights()):
        assert w.data_ptr() == stack[e].data_ptr() and isinstance(w, torch.nn.Parameter)
    after = layer.state_dict()
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[n], t) for n, t in before.items())
    # New storage (a cast or .cuda() of CPU-initialised weights would do the same): the new value counts.
    layer.weight2.data = layer.weight2.data * 3.0
    new_grouped = _run(layer, forward, x, grad)
    assert (
        layer.weight2.data_ptr()
        == layer._grouped_stack.get([w for _, w in layer.lora_base_weights()])[2].data_ptr()
    )
    monkeypatch.setattr(te, "grouped_mm_fits", lambda *a: False)
    new_per_expert = _run(layer, forward, x, grad)
    assert _rel(new_grouped, new_per_expert) <= REL_TOL
    assert _rel(new_grouped, grouped) > 0.01  # expert 2 has tokens: the output did change


def test_frozen_experts_base_keeps_only_its_weights(te, single_rank, monkeypatch):  # noqa: F811
    """For its backward the frozen grouped base keeps the weight stack and the block ends, never the
    routed tokens (the adapters keep theirs; merged here, so only the base runs)."""
    layer = _experts(te)
    for _, w in layer.lora_base_weights():
        w.requires_grad_(False)
    layer.merge()
    monkeypatch.setattr(te, "grouped_mm_fits", lambda *a: True)
    x = torch.randn(sum(SPLITS), 32, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, _ = layer(x, SPLITS)
    assert [tuple(t.shape) for t in saved] == [(len(SPLITS), 24, 32), (len(SPLITS),)]
    assert saved[1].tolist() == [3, 3, 8, 8, 9, 9]
    out.sum().backward()
    want = torch.cat(
        [
            w.sum(0, keepdim=True).expand(n, -1)
            for n, (_, w) in zip(SPLITS, layer.lora_base_weights(), strict=True)
        ]
    )
    assert torch.allclose(x.grad, want, rtol=1e-6, atol=1e-6)


def _frozen_lora_inputs(dtype: torch.dtype, n_in: int = 48, n_out: int = 40, r: int = 8):
    """Routed tokens [rows, in], a frozen weight stack [E, out, in], factors A [E, r, in] and B [E, out,
    r] (B of the order of A, as after training), the blocks' ends (SPLITS) and an output gradient."""
    g = torch.Generator().manual_seed(4)
    e, rows = len(SPLITS), sum(SPLITS)
    x = torch.randn(rows, n_in, generator=g)
    w = torch.randn(e, n_out, n_in, generator=g) * n_in**-0.5
    a = torch.randn(e, r, n_in, generator=g) * n_in**-0.5
    b = torch.randn(e, n_out, r, generator=g) * r**-0.5
    grad = torch.randn(rows, n_out, generator=g)
    ends = torch.tensor(SPLITS).cumsum(0).to(torch.int32)
    return [t.to(dtype) for t in (x, w, a, b, grad)], ends


def _frozen_lora_run(fn, tensors, ends, scaling):
    x, w, a, b, grad = (t.clone() for t in tensors)
    for t in (x, a, b):
        t.requires_grad_(True)
    out = fn(x, w, a, b, ends, scaling)
    out.backward(grad)
    return [out.detach(), x.grad, a.grad, b.grad]


def _frozen_lora_fused(x, w, a, b, ends, scaling):
    return experts.FrozenGroupedLora.apply(x, w, a, b, ends, scaling, None, None)


def _frozen_lora_unfused(x, w, a, b, ends, scaling):
    """The chain the fused function replaces: grouped base, grouped adapter delta, one sum each way (the
    delta's splits go unused: ``ends`` is given)."""
    return experts.FrozenGroupedMM.apply(x, w, ends) + experts.expert_delta_grouped(
        x, a, b, None, scaling, ends
    )


def _frozen_lora_loop(x, w, a, b, ends, scaling):
    """The same math one expert at a time (any dtype: the fp64 reference), blocks from ``ends``."""
    blocks = torch.split(x, torch.diff(ends.cpu(), prepend=ends.new_zeros(1).cpu()).tolist())
    return torch.cat([xe @ w[e].t() + scaling * (xe @ a[e].t()) @ b[e].t() for e, xe in enumerate(blocks)])


@pytest.mark.parametrize("scaling", [1.0, 2.0, 0.75])
def test_frozen_grouped_lora_equals_the_unfused_chain(scaling):
    """Base and adapters in one function (the adapters' products summed into the base's output and input
    gradient in place) against the grouped base plus the grouped delta: fp32 to 1e-5 of the largest
    value (measured 0 on CPU: the same fp32 products and sums); bf16 both within 2**-7 of the fp64
    computation (measured <= 4.3e-3 fused, <= 6.4e-3 unfused), the fused one no worse than the
    unfused one (it rounds each full-size sum once, the unfused chain twice). Experts without
    tokens get zero factor gradients."""
    tensors, ends = _frozen_lora_inputs(torch.float32)
    fused = _frozen_lora_run(_frozen_lora_fused, tensors, ends, scaling)
    assert _rel(fused, _frozen_lora_run(_frozen_lora_unfused, tensors, ends, scaling)) <= REL_TOL
    for grad in fused[2:]:
        assert not grad[[1, 3, 5]].any() and all(grad[i].abs().max() > 0 for i in (0, 2, 4))

    exact = _frozen_lora_run(_frozen_lora_loop, [t.double() for t in tensors], ends, scaling)
    tensors16, _ = _frozen_lora_inputs(torch.bfloat16)
    fused16 = _frozen_lora_run(_frozen_lora_fused, tensors16, ends, scaling)
    unfused16 = _frozen_lora_run(_frozen_lora_unfused, tensors16, ends, scaling)
    for name, f, u, want in zip(("out", "x", "a", "b"), fused16, unfused16, exact, strict=True):
        err_f, err_u = _rel([f.double()], [want]), _rel([u.double()], [want])
        assert err_f <= 2**-7 and err_f <= err_u * 1.25, (name, err_f, err_u)


def test_frozen_grouped_lora_keeps_the_recipe_source_and_rank_r_activations():
    """It keeps the routed tokens (or, given a recipe, its source instead: the gradients are the same bit
    for bit), the weight stack, the factors, the scaled rank-r activation [rows, r] and the ends; no
    full-size output or product."""
    (x, w, a, b, grad), ends = _frozen_lora_inputs(torch.float32)
    source = x * 2.0

    def keep(recipe):
        saved: list[torch.Tensor] = []
        xs, fa, fb = (t.clone().requires_grad_(True) for t in (x, a, b))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = experts.FrozenGroupedLora.apply(xs, w, fa, fb, ends, 0.5, *recipe)
        out.backward(grad)
        return saved, [xs.grad, fa.grad, fb.grad]

    plain, plain_grads = keep((None, None))
    linked, linked_grads = keep((source, lambda s: s / 2.0))
    rows, r = x.shape[0], a.shape[1]
    assert [tuple(t.shape) for t in plain] == [x.shape, w.shape, a.shape, b.shape, (rows, r), ends.shape]
    h = torch.cat([blk @ a[e].t() for e, blk in enumerate(torch.split(x, SPLITS))]) * 0.5
    assert torch.equal(plain[0], x) and torch.allclose(plain[4], h, rtol=1e-6, atol=1e-6)
    assert linked[0] is source and all(t is not x for t in linked)
    assert all(torch.equal(p, q) for p, q in zip(plain_grads, linked_grads, strict=True))


# -- GPU: torch's grouped GEMM in bf16 -------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch grouped GEMM, sm90, bf16)")
def test_grouped_mm_bf16_cuda_matches_loop():
    """The CUDA grouped-GEMM path in bf16 (Qwen3-30B-A3B-like expert fc1 shape, r=16, uneven routing
    with zero-token experts) against the per-expert loop: both judged against the fp32 loop."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("torch's grouped GEMM path is enabled on sm90 (H100/H200) only")
    g = torch.Generator().manual_seed(0)
    n_experts, n_in, n_out, r = 16, 2048, 1536, 32
    splits = [int(v) for v in torch.randint(0, 300, (n_experts,), generator=g)]
    splits[1] = splits[7] = splits[-1] = 0
    x32 = torch.randn(sum(splits), n_in, generator=g)
    a32 = torch.randn(n_experts, r, n_in, generator=g) * n_in**-0.5
    b32 = torch.randn(n_experts, n_out, r, generator=g) * 0.1
    grad32 = torch.randn(sum(splits), n_out, generator=g)

    def run(fn, dtype):
        x, a, b = (t.to("cuda", dtype).requires_grad_(True) for t in (x32, a32, b32))
        y = fn(x, a, b, splits, 2.0)
        (y.float() * grad32.cuda()).sum().backward()
        return [t.float().cpu() for t in (y, x.grad, a.grad, b.grad)]

    bf16 = (x32.cuda().bfloat16(), a32.cuda().bfloat16(), b32.cuda().bfloat16())
    assert experts.grouped_mm_fits(bf16[0], splits, *bf16[1:])
    truth = run(experts.expert_delta_loop, torch.float32)
    grouped = run(experts.expert_delta_grouped, torch.bfloat16)
    loop = run(experts.expert_delta_loop, torch.bfloat16)
    for name, t, gr, lo in zip(("out", "dx", "dA", "dB"), truth, grouped, loop, strict=True):
        cos = F.cosine_similarity(gr.flatten().double(), t.flatten().double(), dim=0).item()
        assert cos >= 0.999, (name, cos)
        # no worse than the loop in bf16 (up to bf16 rounding of either)
        assert (gr - t).abs().max() <= 2 * (lo - t).abs().max() + 1e-2 * t.abs().max(), name
    for t in grouped[2:]:
        assert not t[[1, 7, n_experts - 1]].any()  # zero-token experts: exactly zero gradient


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch grouped GEMM, sm90, bf16)")
@pytest.mark.parametrize("n_in,n_out", [(2048, 1536), (768, 2048)], ids=["fc1", "fc2"])
def test_frozen_grouped_lora_bf16_cuda_matches_fp64(n_in, n_out):
    """Base and adapters in one function on the GPU (CUTLASS grouped GEMMs, the in-place sum's Triton
    kernel) at Qwen3-30B-A3B's expert widths (r 16, 128 experts, uneven routing with empty experts),
    against the fp64 per-expert computation: output and the gradients of x, A and B within 2**-7 of the
    largest value, and no worse than the unfused chain (grouped base + grouped delta + sums) in bf16 but
    for 1e-3 of the largest value (the sums round once instead of twice; elsewhere the same GEMMs)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("torch's grouped GEMM path is enabled on sm90 (H100/H200) only")
    g = torch.Generator().manual_seed(0)
    splits = [int(v) for v in torch.randint(0, 96, (128,), generator=g)]
    splits[0] = splits[50] = splits[-1] = 0
    rows, r = sum(splits), 16
    x = torch.randn(rows, n_in, generator=g)
    w = torch.randn(128, n_out, n_in, generator=g) * n_in**-0.5
    a = torch.randn(128, r, n_in, generator=g) * n_in**-0.5
    b = torch.randn(128, n_out, r, generator=g) * 0.1
    grad = torch.randn(rows, n_out, generator=g)
    ends = torch.tensor(splits).cumsum(0).to(torch.int32).cuda()

    def run(fn, dtype, device="cuda"):
        xs, fa, fb = (t.to(device, dtype).requires_grad_(True) for t in (x, a, b))
        out = fn(xs, w.to(device, dtype), fa, fb, ends.to(device), 2.0)
        out.backward(grad.to(device, dtype))
        return [t.double().cpu() for t in (out.detach(), xs.grad, fa.grad, fb.grad)]

    exact = run(_frozen_lora_loop, torch.float64, "cpu")
    fused = run(_frozen_lora_fused, torch.bfloat16)
    chain = run(_frozen_lora_unfused, torch.bfloat16)
    for name, f, c, want in zip(("out", "x", "a", "b"), fused, chain, exact, strict=True):
        scale = want.abs().max()
        err_f, err_c = (f - want).abs().max() / scale, (c - want).abs().max() / scale
        assert err_f <= 2**-7 and err_f <= err_c + 1e-3, (name, err_f.item(), err_c.item())
    for t in fused[2:]:
        assert not t[[0, 50, 127]].any()  # empty experts: exactly zero gradient


def test_sharded_factories_cut_and_rebuild_the_stacked_factors(single_rank):  # noqa: F811
    """The checkpoint view of the stacked factors: each parameter's ShardedTensorFactory writes one tensor
    per slot under the per-slot key (the slot's factor, a smaller rank's B without its unused columns)
    and rebuilds the parameter from them on load, unused columns zero."""
    slots = CASES["qkv-ranks"][1]
    layer = _portable("linear_qkv", slots)
    randomize_layer(layer)
    sd = layer.sharded_state_dict("qkv.", (), {"dp_cp_group": None})
    for which in "AB":
        factory, param = sd[f"qkv.lora_{which}"], getattr(layer, f"lora_{which}")
        assert factory.data is param  # what megatron's optimizer looks its parameters up by
        built = factory.build()
        assert sorted(built) == sorted(f"qkv.lora_{which}.{s}" for s in slots)
        for slot in slots:
            t = built[f"qkv.lora_{which}.{slot}"]
            assert t.key == f"qkv.lora_{which}.{slot}" and t.replica_id == factory.replica_id
            assert torch.equal(t.data, layer.lora_factor(which, slot))
        rebuilt = factory.merge_fn({k: t.data.clone() for k, t in built.items()})
        assert torch.equal(rebuilt, param)
    assert layer.lora_B.shape == (128, 8) and not layer.lora_B[64:96, 2:].any()  # k_proj: r=2 of 8
