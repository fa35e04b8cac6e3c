"""Transformer Engine path on a GPU: megatron logits vs transformers logits, fp32 and bf16.

Writes the measured statistics to $TWINKLE_EVIDENCE_DIR/gpu-parity.json when that is set.
"""

from __future__ import annotations

import pytest
import torch
from gpu_checks import (
    BF16_ERROR_RATIO,
    BF16_MIN_COSINE,
    FP32_MEAN_ABS,
    FP32_MIN_COSINE,
    Evidence,
    fp32_max_abs,
    fp32_router,
)
from models import YARN_SEQ, batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with Transformer Engine"),
]

EVIDENCE = Evidence("gpu-parity.json")


@pytest.fixture(scope="module")
def single_gpu():
    from twinkle_specs.parity import _init_single_process

    _init_single_process()
    import transformer_engine  # noqa: F401  (the point of this module: the TE path)


@pytest.mark.parametrize("kind", ["qwen2", "qwen2_5", "qwen3", "qwen3_moe", "qwen3_moe_nonorm", "qwen2_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_te_path_matches_transformers(kind, dtype, checkpoints, single_gpu):
    from transformers import AutoModelForCausalLM

    import twinkle_specs as ts
    from twinkle_specs.parity import compare_logits

    hf = checkpoints(kind)
    model = ts.build_model(
        hf,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        parallel_output=False,
        **fp32_router(kind, dtype),
    ).eval()
    assert model.config.transformer_impl == "transformer_engine"
    assert "TE" in type(model.decoder.layers[0].self_attention.linear_qkv).__name__
    tokens = batch(s=128).cuda()
    with torch.no_grad():
        ours = model(tokens, torch.arange(tokens.shape[1], device="cuda").expand_as(tokens), None)
        ref = AutoModelForCausalLM.from_pretrained(hf, dtype=dtype).cuda().eval()(tokens).logits
        truth = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).cuda().eval()(tokens).logits
    stats = compare_logits(ours, ref)
    name = f"{kind}-{str(dtype).removeprefix('torch.')}"
    if dtype == torch.float32:
        EVIDENCE.record(name, **stats.as_dict())
        assert stats.max_abs <= fp32_max_abs(kind), stats
        assert stats.mean_abs <= FP32_MEAN_ABS, stats
        assert stats.cosine >= FP32_MIN_COSINE, stats
        return
    ours_err, hf_err = compare_logits(ours, truth), compare_logits(ref, truth)
    EVIDENCE.record(
        name,
        vs_transformers_bf16=stats.as_dict(),
        ours_vs_fp32=ours_err.as_dict(),
        transformers_bf16_vs_fp32=hf_err.as_dict(),
    )
    assert ours_err.mean_abs <= BF16_ERROR_RATIO * hf_err.mean_abs, (ours_err, hf_err)
    assert ours_err.cosine >= BF16_MIN_COSINE, ours_err


@pytest.mark.parametrize(
    "kind",
    [
        "qwen3_yarn",
        "qwen2_yarn",
        "qwen3_yarn_mscale",
        pytest.param(
            "qwen3_moe_yarn",
            marks=pytest.mark.xfail(
                reason="measured on H200 (core_v0.19, fp64 router): max |Δ| 0.298 > 0.25 at one position, "
                "mean 1.2e-3, argmax agreement 1.0; not diagnosed yet (a routing near-tie is suspected, "
                "not shown)",
                strict=False,
            ),
        ),
    ],
)
def test_te_path_yarn_matches_transformers(kind, checkpoints, single_gpu):
    """YaRN on the TE path (megatron-core's YarnRotaryEmbedding on the GPU, its unfused RoPE with the
    attention factor, TE core attention), fp32, 3x past original_max_position_embeddings."""
    from transformers import AutoModelForCausalLM

    import twinkle_specs as ts
    from twinkle_specs.parity import compare_logits

    hf = checkpoints(kind)
    model = ts.build_model(
        hf, params_dtype=torch.float32, parallel_output=False, **fp32_router(kind, torch.float32)
    ).eval()
    assert model.config.transformer_impl == "transformer_engine" and model.position_embedding_type == "yarn"
    assert not model.config.apply_rope_fusion  # TE's fused RoPE cannot apply the attention factor
    tokens = batch(s=YARN_SEQ).cuda()
    with torch.no_grad():
        ours = model(tokens, torch.arange(tokens.shape[1], device="cuda").expand_as(tokens), None)
        ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).cuda().eval()(tokens).logits
    stats = compare_logits(ours, ref)
    EVIDENCE.record(f"{kind}-float32-seq{YARN_SEQ}", **stats.as_dict())
    assert stats.max_abs <= fp32_max_abs(kind), stats
    assert stats.mean_abs <= FP32_MEAN_ABS, stats
    assert stats.cosine >= FP32_MIN_COSINE, stats


def test_embedded_default_bf16(single_gpu):
    from twinkle_specs.parity import run_parity

    stats, _ = run_parity(seq_len=512, dtype=torch.bfloat16)
    EVIDENCE.record("qwen3-tiny-default-bfloat16-seq512", **stats.as_dict())
    assert stats.cosine >= BF16_MIN_COSINE and stats.argmax_agreement >= 0.95, stats
