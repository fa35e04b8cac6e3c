"""FlashAttention-4 as the core attention (GPU, ``twinkle_specs.flash_attention``): against Transformer Engine's
attention and an fp32 truth, under a CUDA graph, and in a LoRA model's training step.

Tolerances: bf16 attention is judged against the fp32 truth (SDPA's math backend in fp32 on the same bf16
inputs): FlashAttention-4's relative error (Frobenius) at most 5e-3 (measured 2.0e-3 to 2.5e-3) and at most 1.5x
TE's plus 1e-4, output and each input gradient; on packed rows TE is no reference where its cuDNN trains them
wrong (``twinkle_specs.packed_attention_check``: heads of 256 on Hopper with cuDNN before 9.18). The LoRA model: logits' cosine with TE's model at least 0.999 and every adapter gradient within
2e-2 of the largest (bf16 attention at a different summation order, through two layers). The measured values
go to $TWINKLE_EVIDENCE_DIR/flash-attention-gpu.json when that is set.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_checks import BF16_MIN_COSINE, Evidence, count_calls

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with Transformer Engine"),
]

EVIDENCE = Evidence("flash-attention-gpu.json")
ERROR_RATIO, ERROR_FLOOR = 1.5, 1e-4
ERROR_MAX = 5e-3
GRAD_REL = 2e-2


@pytest.fixture(scope="module")
def flash_attn_4():
    pytest.importorskip("flash_attn.cute", reason="needs FlashAttention-4 (the flash-attn-4 extra)")


def _attention_config(heads: int, groups: int, head_dim: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _run(attn, q, k, v, dout):
    from megatron.core.transformer.enums import AttnMaskType

    qi, ki, vi = (t.view_as(t) for t in (q, k, v))  # made on the calling stream (a graph's, when captured)
    out = attn(qi, ki, vi, None, attn_mask_type=AttnMaskType.causal)
    return (out, *torch.autograd.grad(out, (qi, ki, vi), dout))


# Qwen3-8B's heads, a small shape at two micro-batches, and the hybrids' gated attention (Qwen3.5-9B: 16 query
# heads, 4 groups, head dim 256)
@pytest.mark.parametrize(
    ("heads", "groups", "head_dim", "batch"), [(32, 8, 128, 1), (8, 2, 64, 2), (16, 4, 256, 1)]
)
def test_matches_te_attention_against_fp32_truth(flash_attn_4, gpu, heads, groups, head_dim, batch):
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from twinkle_specs.flash_attention import flash_attention_4_class

    config = _attention_config(heads, groups, head_dim)
    make = lambda cls: cls(config, 1, AttnMaskType.causal, "self")  # noqa: E731
    te_attn, fa4 = make(TEDotProductAttention), make(flash_attention_4_class())
    assert fa4.flash_attn_4_scale == pytest.approx(head_dim**-0.5)
    g = torch.Generator(device="cuda").manual_seed(0)
    s = 1024
    rand = lambda h: torch.randn(s, batch, h, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    q, k, v = (rand(h).requires_grad_() for h in (heads, groups, groups))
    dout = torch.randn(s, batch, heads * head_dim, device="cuda", generator=g, dtype=torch.bfloat16)

    qf, kf, vf = (t.detach().float().permute(1, 2, 0, 3).requires_grad_() for t in (q, k, v))
    truth_out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=True)
    truth_out = truth_out.permute(2, 0, 1, 3).reshape(s, batch, -1)
    truth = (
        truth_out,
        *(t.permute(2, 0, 1, 3) for t in torch.autograd.grad(truth_out, (qf, kf, vf), dout.float())),
    )

    ours, theirs = _run(fa4, q, k, v, dout), _run(te_attn, q, k, v, dout)
    names = ("out", "dq", "dk", "dv")
    stats = {
        f"{n}_rel_err": {"flash_attn_4": _rel(a, t), "te": _rel(b, t)}
        for n, a, b, t in zip(names, ours, theirs, truth, strict=True)
    }

    # the same under a CUDA graph: captured once, replayed, the eager result bit for bit
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            _run(fa4, q, k, v, dout)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _run(fa4, q, k, v, dout)
    graph.replay()
    torch.cuda.synchronize()
    stats["graph_max_rel_diff"] = max(_rel(c, e) for c, e in zip(captured, ours, strict=True))
    EVIDENCE.record(f"attention-h{heads}-g{groups}-d{head_dim}-b{batch}", **stats)
    for n in names:
        err = stats[f"{n}_rel_err"]
        assert err["flash_attn_4"] <= ERROR_MAX, (n, stats)
        assert err["flash_attn_4"] <= ERROR_RATIO * err["te"] + ERROR_FLOOR, (n, stats)
    # the query gradient's atomic sums may land in another order on replay: a few last bits of dq
    assert stats["graph_max_rel_diff"] <= 1e-3, stats


def test_lora_model_on_flash_attention_4_trains_as_on_te(flash_attn_4, lora_checkpoints, gpu, monkeypatch):
    from test_lora_gpu import _bf16_lora_model
    from test_lora_support import VOCAB, randomize_megatron, tokens

    from twinkle_specs import flash_attention
    from twinkle_specs.parallel import is_adapter_param

    hf = lora_checkpoints("qwen3")
    calls = count_calls(monkeypatch, flash_attention, "attend")

    def model(fa4: bool):
        built = _bf16_lora_model(hf, parallel_output=False, flash_attn_4=fa4)
        randomize_megatron(built)
        return built

    toks = tokens(s=128).cuda()
    pos = torch.arange(toks.shape[1], device="cuda").expand_as(toks)
    results = {}
    for fa4 in (False, True):
        m = model(fa4)
        kinds = {type(mod).__name__ for mod in m.modules() if "Attention" in type(mod).__name__}
        assert ("FlashAttention4" in kinds) is fa4, kinds
        logits = m(toks, pos, None)[..., :VOCAB].float()
        F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), toks[:, 1:].reshape(-1)).backward()
        grads = {n: p.grad.float() for n, p in m.named_parameters() if is_adapter_param(n)}
        results[fa4] = (logits.detach(), grads)
    assert len(calls) == 2, calls  # one call per layer, FlashAttention-4's model only
    (te_logits, te_grads), (fa_logits, fa_grads) = results[False], results[True]
    cosine = F.cosine_similarity(fa_logits.flatten().double(), te_logits.flatten().double(), dim=0).item()
    scale = max(g.abs().max().item() for g in te_grads.values())
    worst = max((fa_grads[n] - g).abs().max().item() for n, g in te_grads.items()) / scale
    EVIDENCE.record("lora-qwen3-tiny", logits_cosine=cosine, grad_max_abs_over_largest=worst)
    assert cosine >= BF16_MIN_COSINE, cosine
    assert worst <= GRAD_REL, worst


def _run_packed(attn, q, k, v, dout, params):
    """``attn`` on a packed row's [tokens, heads, d] query / key / value (causal inside each sequence), and the
    gradients of ``dout`` through it: (out, dq, dk, dv)."""
    from megatron.core.transformer.enums import AttnMaskType

    qi, ki, vi = (t.view_as(t) for t in (q, k, v))
    out = attn(qi, ki, vi, None, attn_mask_type=AttnMaskType.padding_causal, packed_seq_params=params)
    out = out.reshape(q.shape[0], -1)
    return (out, *torch.autograd.grad(out, (qi, ki, vi), dout))


def _thd_params(real: list[int], padded: list[int] | None):
    """megatron's THD PackedSeqParams as TE takes them, from sequence lengths: the real bounds, and the padded
    ones where given."""
    import numpy as np
    from test_sft import _packed_params

    def cu(lengths):
        return (
            None
            if lengths is None
            else torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32, device="cuda")
        )

    return _packed_params(cu(real), cu(padded))


@pytest.mark.parametrize(("heads", "groups", "head_dim"), [(32, 8, 128), (16, 4, 256)], ids=["d128", "d256"])
@pytest.mark.parametrize("padded", [False, True], ids=["bounds", "padded-bounds"])
def test_packed_rows_match_te_attention_against_fp32_truth(
    flash_attn_4, gpu, padded, heads, groups, head_dim, monkeypatch
):
    """A packed row of five sequences (one of a single token) at Qwen3-8B's and Qwen3.5-9B's attention heads:
    FlashAttention-4's varlen call against TE's THD attention, both against each sequence alone in fp32, on the
    real tokens. With padded bounds (each sequence padded to a multiple of 64, as context parallelism pads) the
    padding takes no loss (zero output gradient), as megatron's SFT loss mask has it."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from twinkle_specs import flash_attention, packed_attention_check

    calls = count_calls(monkeypatch, flash_attention, "attend_packed")
    config = _attention_config(heads, groups, head_dim)
    make = lambda cls: cls(config, 1, AttnMaskType.causal, "self")  # noqa: E731
    te_attn, fa4 = make(TEDotProductAttention), make(flash_attention.flash_attention_4_class())
    real = [700, 1, 1500, 297, 1598]
    lengths = [-(-n // 64) * 64 for n in real] if padded else real
    params = _thd_params(real, lengths if padded else None)
    tokens = sum(lengths)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    used = torch.zeros(tokens, dtype=torch.bool, device="cuda")
    for a, n in zip(starts, real, strict=True):
        used[a : a + n] = True
    g = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda h: torch.randn(tokens, h, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    q, k, v = (rand(h).requires_grad_() for h in (heads, groups, groups))
    dout = torch.randn(tokens, heads * head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    dout[~used] = 0

    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    outs = []
    for a, n in zip(starts, real, strict=True):
        one = [t[a : a + n].transpose(0, 1)[None] for t in (qf, kf, vf)]  # [1, h, n, d]
        out = F.scaled_dot_product_attention(*one, is_causal=True, enable_gqa=True)
        outs.append((a, out[0].transpose(0, 1).reshape(n, -1)))
    truth_out = torch.zeros(tokens, heads * head_dim, device="cuda")
    for a, out in outs:
        truth_out = truth_out.index_put((torch.arange(a, a + out.shape[0], device="cuda"),), out)
    truth = (truth_out, *torch.autograd.grad(truth_out, (qf, kf, vf), dout.float()))

    ours, theirs = (_run_packed(attn, q, k, v, dout, params) for attn in (fa4, te_attn))
    assert len(calls) == 1, calls
    names = ("out", "dq", "dk", "dv")
    stats = {
        f"{n}_rel_err": {"flash_attn_4": _rel(a[used], t[used]), "te": _rel(b[used], t[used])}
        for n, a, b, t in zip(names, ours, theirs, truth, strict=True)
    }
    stats["padding_grads_max_abs"] = max(t[~used].abs().max().item() for t in ours[1:]) if padded else 0.0
    stats["te_refused"] = packed_attention_check.current_refusal(head_dim) is not None
    EVIDENCE.record(f"packed-h{heads}-g{groups}-d{head_dim}-{'padded' if padded else 'plain'}", **stats)
    for n in names:
        err = stats[f"{n}_rel_err"]
        assert err["flash_attn_4"] <= ERROR_MAX, (n, stats)
        if not stats["te_refused"]:
            assert err["flash_attn_4"] <= ERROR_RATIO * err["te"] + ERROR_FLOOR, (n, stats)
    assert stats["padding_grads_max_abs"] == 0.0, stats  # no loss there, no gradient from there


def test_deterministic_backward_repeats_bit_for_bit(flash_attn_4, gpu):
    """TE's determinism setting (``deterministic``, from NVTE_ALLOW_NONDETERMINISTIC_ALGO=0) reaches
    FlashAttention-4's backward: two runs give the same gradients bit for bit, plain and packed."""
    from megatron.core.transformer.enums import AttnMaskType

    from twinkle_specs.flash_attention import flash_attention_4_class

    config = _attention_config(32, 8, 128)
    fa4 = flash_attention_4_class()(config, 1, AttnMaskType.causal, "self")
    fa4.deterministic = True
    g = torch.Generator(device="cuda").manual_seed(1)
    s = 2048
    rand = lambda h: torch.randn(s, 1, h, 128, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    q, k, v = (rand(h).requires_grad_() for h in (32, 8, 8))
    dout = torch.randn(s, 1, 32 * 128, device="cuda", generator=g, dtype=torch.bfloat16)
    params = _thd_params([500, 1000, 548], None)
    repeats = {}
    for name, call in {
        "plain": lambda: _run(fa4, q, k, v, dout)[1:],
        "packed": lambda: _run_packed(fa4, *(t[:, 0] for t in (q, k, v)), dout[:, 0], params)[1:],
    }.items():
        first, second = call(), call()
        repeats[name] = all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    EVIDENCE.record("deterministic-backward", bitwise_equal=repeats)
    assert all(repeats.values()), repeats
