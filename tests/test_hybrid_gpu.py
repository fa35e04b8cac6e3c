"""The hybrid Qwen models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) on a GPU: ``build_model``'s CUDA model (Transformer
Engine linears and attention; fla's chunked gated delta rule and causal-conv1d where installed) against
transformers' fp32 logits on the GPU, in fp32 and bf16, with the bf16 error bounded by transformers' own bf16 error.

Writes the measured statistics to $TWINKLE_EVIDENCE_DIR/hybrid-gpu.json when that is set.
"""

from __future__ import annotations

import pytest
import torch
from gpu_checks import BF16_ERROR_RATIO, FP32_MOE_MAX_ABS, HYBRID_FP32_MAX_ABS, Evidence
from hybrid_models import VOCAB, hybrid_batch, make_hybrid_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with Transformer Engine"),
]

EVIDENCE = Evidence("hybrid-gpu.json")
# Qwen3.5-MoE: FP32_MOE_MAX_ABS covers a routing near-tie as for Qwen3-MoE (0.219 at one position, 2026-11-25).
HYBRID_FP32_MEAN_ABS = 3e-3


def _transformers_logits(hf, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers on the GPU (with fla installed its Gated DeltaNet takes fla's kernels, which refuse
    host tensors), in ``dtype``, as fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=dtype).cuda().eval()
    with torch.no_grad():
        return model(tokens).logits.float()


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hybrid_cuda_path_matches_transformers(kind, dtype, tmp_path_factory, gpu):
    import twinkle_specs as ts
    from twinkle_specs.parity import compare_logits

    hf = make_hybrid_checkpoint(kind, tmp_path_factory.mktemp("hybrid") / kind)
    model = ts.build_model(hf, params_dtype=dtype, bf16=dtype == torch.bfloat16, parallel_output=False).eval()
    tokens = hybrid_batch().cuda()
    with torch.no_grad():
        pos = torch.arange(tokens.shape[1], device="cuda").expand_as(tokens)
        ours = model(tokens, pos, None)[..., :VOCAB].float()
    truth = _transformers_logits(hf, tokens, torch.float32)  # the reference
    layers = model.decoder.layers
    kinds = sorted({f"{type(m.self_attention).__name__}/{type(m.mlp).__name__}" for m in layers})
    name = f"{kind}-{str(dtype).removeprefix('torch.')}"
    stats = compare_logits(ours, truth)
    if dtype == torch.float32:
        EVIDENCE.record(name, modules=kinds, **stats.as_dict())
        moe = kind in ("qwen3_next", "qwen3_5_moe")
        assert stats.max_abs <= (FP32_MOE_MAX_ABS if moe else HYBRID_FP32_MAX_ABS), stats
        assert stats.mean_abs <= HYBRID_FP32_MEAN_ABS, stats
        return
    ref = _transformers_logits(hf, tokens, torch.bfloat16)
    hf_err = compare_logits(ref, truth)
    EVIDENCE.record(
        name, modules=kinds, ours_vs_fp32=stats.as_dict(), transformers_bf16_vs_fp32=hf_err.as_dict()
    )
    # bf16 error bounded by transformers' own bf16 error (these tiny random models drift further in bf16
    # than the dense test models: transformers itself reaches cosine 0.9971 against its fp32 run).
    assert stats.mean_abs <= BF16_ERROR_RATIO * hf_err.mean_abs, (stats, hf_err)
    assert 1 - stats.cosine <= BF16_ERROR_RATIO * (1 - hf_err.cosine), (stats, hf_err)


# fla's gated delta rule with its gated chunk_bwd_dqkwg in torch (twinkle_specs.gdn_dqkwg) against the
# autograd of megatron-core's torch reference of the whole rule, fp32 inputs; bound: relative max |Δ| of
# each gradient to that gradient's largest entry (fla's other kernels run TF32 dots)
DQKWG_GRAD_RTOL = 2e-2


@pytest.mark.parametrize(
    "seq,cuts,key_heads",
    [(256, None, 4), (300, None, 4), (300, [0, 37, 100, 101, 229, 300], 4), (300, None, 2)],
    # packed: fla's varlen rule, one row; grouped: 2 key heads for 4 value heads (fla's GVA, as
    # PortableGatedDeltaNet calls it), against the reference on q and k repeated per value head
    ids=["whole-chunks", "partial-last-chunk", "packed", "grouped-value-heads"],
)
def test_fla_rule_with_the_torch_dqkwg_matches_the_torch_reference(seq, cuts, key_heads):
    pytest.importorskip("fla", reason="needs flash-linear-attention (pip install .[hybrid-gpu])")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

    from twinkle_specs import gdn_dqkwg
    from twinkle_specs.gdn import l2norm

    gdn_dqkwg.enable()
    calls = []
    real = gdn_dqkwg.chunk_bwd_dqkwg
    gdn_dqkwg.chunk_bwd_dqkwg = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        torch.manual_seed(0)
        b, heads, dk, dv = 2 if cuts is None else 1, 4, 64, 128
        inputs = {
            "q": torch.randn(b, seq, key_heads, dk, device="cuda"),
            "k": torch.randn(b, seq, key_heads, dk, device="cuda"),
            "v": torch.randn(b, seq, heads, dv, device="cuda"),
            "g": -torch.rand(b, seq, heads, device="cuda") * 0.5,  # log decay per token
            "beta": torch.rand(b, seq, heads, device="cuda").sigmoid(),
        }
        do = torch.randn(b, seq, heads, dv, device="cuda")

        def grads(run) -> dict[str, torch.Tensor]:
            leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
            out = run(**leaves)
            out.backward(do)
            return {n: t.grad for n, t in leaves.items()}

        cu = None if cuts is None else torch.tensor(cuts, device="cuda")
        spans = [(0, seq)] if cuts is None else list(zip(cuts[:-1], cuts[1:], strict=True))
        fla = grads(
            lambda q, k, v, g, beta: chunk_gated_delta_rule(
                q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu
            )[0]
        )
        group = heads // key_heads

        def reference(q, k, v, g, beta):  # each packed sequence alone, q and k repeated per value head
            q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
            return torch.cat(
                [
                    torch_chunk_gated_delta_rule(
                        l2norm(q[:, a:e]), l2norm(k[:, a:e]), v[:, a:e], g=g[:, a:e], beta=beta[:, a:e]
                    )[0]
                    for a, e in spans
                ],
                dim=1,
            )

        ref = grads(reference)
    finally:
        gdn_dqkwg.chunk_bwd_dqkwg = real
    assert calls, "fla did not call twinkle_specs.gdn_dqkwg.chunk_bwd_dqkwg"
    rel = {n: ((fla[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in inputs}
    tag = f"{'-packed' if cuts else ''}{'-grouped' if key_heads < heads else ''}"
    EVIDENCE.record(f"fla-rule-torch-dqkwg-seq{seq}{tag}", grad_rel_max_abs=rel)
    print(seq, rel)
    assert max(rel.values()) <= DQKWG_GRAD_RTOL, rel


# The Gated DeltaNet's token mixing on the CUDA path in bf16 (in_proj's output split and convolved by
# twinkle_specs.gdn_conv in one, q and k at their own head count into fla's rule, the torch dqkwg) against the
# same layer's portable path in fp32 (torch's conv1d, q and k repeated, megatron-core's torch rule): the output
# and the gradients of in_proj's output and of the layer's own parameters, each as relative max |Δ| to its
# largest entry (bf16 rounding of the convolution, fla's TF32 dots). Measured on an H100 (2026-11-27), rows:
# in_proj output 2.7e-2, output 1.9e-2, conv weight 1.6e-2, out_norm weight 1.1e-2, dt_bias 8.0e-3, A_log
# 6.7e-3; packed within 3e-2. An indexing or head-grouping error is O(1).
MIX_BF16_RTOL = 4e-2


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_gdn_mixing_cuda_path_gradients_match_the_portable_path(packed, tmp_path_factory, gpu):
    import twinkle_specs as ts
    from twinkle_specs.packed_sequences import PackedRow

    hf = make_hybrid_checkpoint("qwen3_5", tmp_path_factory.mktemp("mixing") / "qwen3_5")
    layer, reference = (
        ts.build_model(hf, params_dtype=dtype, bf16=dtype == torch.bfloat16).decoder.layers[0].self_attention
        for dtype in (torch.bfloat16, torch.float32)
    )
    assert layer.num_value_heads > layer.num_key_heads  # the grouped case
    reference.config.deterministic_mode = True  # the portable path: torch's convolution and rule
    batch, seq = (1, 300) if packed else (2, 300)
    spans = [(0, 37), (37, 101), (101, 102), (102, 300)]
    row = PackedRow(spans, torch.device("cuda")) if packed else None
    torch.manual_seed(0)
    x = torch.randn(seq, batch, layer.in_proj_dim, device="cuda")  # in_proj's output, [s, b, x]
    dy = torch.randn(batch, seq, layer.v_dim, device="cuda")

    def run(module, dtype):
        module.zero_grad()
        leaf = x.to(dtype).requires_grad_()
        out = module._mix(leaf.transpose(0, 1), row)
        out.backward(dy.to(dtype))
        grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
        return out.float(), {"in_proj output": leaf.grad.float(), **{n: g.float() for n, g in grads.items()}}

    ours, ours_grads = run(layer, torch.bfloat16)
    ref, ref_grads = run(reference, torch.float32)
    assert ours_grads.keys() == ref_grads.keys() and "conv1d.weight" in ours_grads, ours_grads.keys()
    rel = {"output": ((ours - ref).abs().max() / ref.abs().max()).item()}
    rel |= {n: ((ours_grads[n] - g).abs().max() / g.abs().max()).item() for n, g in ref_grads.items()}
    EVIDENCE.record(f"gdn-mixing-bf16-vs-portable-fp32-{'packed' if packed else 'rows'}", rel_max_abs=rel)
    print(rel)
    assert max(rel.values()) <= MIX_BF16_RTOL, rel
