"""The hybrid Qwen models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) on a GPU: ``build_model``'s CUDA model (Transformer
Engine linears and attention; fla's chunked gated delta rule and causal-conv1d where installed) against
transformers' fp32 logits on the GPU, in fp32 and bf16, with the bf16 error bounded by transformers' own bf16 error.

Writes the measured statistics to $TWINKLE_EVIDENCE_DIR/hybrid-gpu.json when that is set.
"""

from __future__ import annotations

import pytest
import torch
from gpu_checks import BF16_ERROR_RATIO, FP32_MOE_MAX_ABS, Evidence
from hybrid_models import VOCAB, hybrid_batch, make_hybrid_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with Transformer Engine"),
]

EVIDENCE = Evidence("hybrid-gpu.json")
# fp32 on an H100, both models on CUDA with fla's Triton kernels for the gated delta rule (2026-11-25):
# max |Δ| 1.17e-2 (Qwen3-Next) and 1.28e-2 (Qwen3.5), mean 8.8e-4 to 1.3e-3; Qwen3.5-MoE 0.219 at one
# position (a routing near-tie, argmax agreement 0.994; FP32_MOE_MAX_ABS covers it as for Qwen3-MoE).
HYBRID_FP32_MAX_ABS = 3e-2
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
