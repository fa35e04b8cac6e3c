"""Transformer Engine's packed-row attention at the hybrids' heads (Qwen3.5-9B: 16 query / 4 key-value heads of
256) on this GPU and the cuDNN TE loaded: right against an fp32 truth, or refused where
``twinkle_specs.packed_attention_check`` says its cuDNN trains it wrong, and then wrong indeed (the refusal's
premise, checked on the GPU it refuses on).

Tolerances (relative Frobenius error against each sequence alone in fp32, output and each input gradient):
right is at most 5e-3 (measured on an H200: 2.0e-3 to 3.0e-3 with cuDNN 9.19.0, as at head dim 128); wrong is
a gradient NaN or above 5e-2 (measured with cuDNN 9.14.0: dq 0.19, dk and dv NaN). The values go to
$TWINKLE_EVIDENCE_DIR/packed-attention-check-gpu.json when that is set. Run it under both cuDNNs of an image
that has two: as it comes, and with ``CUDNN_HOME`` and ``LD_LIBRARY_PATH`` at the newer one.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from gpu_checks import Evidence
from test_flash_attention_gpu import _attention_config, _rel, _run_packed, _thd_params

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with Transformer Engine"),
]

EVIDENCE = Evidence("packed-attention-check-gpu.json")
RIGHT, WRONG = 5e-3, 5e-2
NAMES = ("out", "dq", "dk", "dv")


def test_te_packed_attention_at_head_dim_256_is_right_or_refused(gpu):
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from twinkle_specs import packed_attention_check as check

    heads, groups, head_dim = 16, 4, 256
    config = _attention_config(heads, groups, head_dim)
    te_attn = TEDotProductAttention(config, 1, AttnMaskType.causal, "self")
    checked = check.checked_te_attention_class()(config, 1, AttnMaskType.causal, "self")
    real = [700, 1, 1500, 297, 1598]
    params, tokens = _thd_params(real, None), sum(real)
    starts = [sum(real[:i]) for i in range(len(real))]
    g = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda h: torch.randn(tokens, h, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    q, k, v = (rand(h).requires_grad_() for h in (heads, groups, groups))
    dout = torch.randn(tokens, heads * head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    pieces = []
    for a, n in zip(starts, real, strict=True):
        one = [t[a : a + n].transpose(0, 1)[None] for t in (qf, kf, vf)]  # [1, h, n, d]
        pieces.append(
            F.scaled_dot_product_attention(*one, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        )
    truth_out = torch.cat(pieces).reshape(tokens, -1)
    truth = (truth_out, *torch.autograd.grad(truth_out, (qf, kf, vf), dout.float()))

    def run(attn):
        return _run_packed(attn, q, k, v, dout, params)

    errors = {n: _rel(a, t) for n, a, t in zip(NAMES, run(te_attn), truth, strict=True)}
    problem = check.current_refusal(head_dim)
    EVIDENCE.record(
        f"te-packed-h{heads}-g{groups}-d{head_dim}-cudnn{check.te_cudnn_version()}",
        capability=list(torch.cuda.get_device_capability()),
        cudnn=check.te_cudnn_version(),
        refused=problem is not None,
        te_rel_err=errors,
    )
    if problem is None:
        assert all(e <= RIGHT for e in errors.values()), errors
        run(checked)  # served: the check lets it through
        return
    grads = [errors[n] for n in NAMES[1:]]
    assert any(not math.isfinite(e) or e > WRONG for e in grads), (errors, problem)  # the premise holds here
    with pytest.raises(RuntimeError, match=r"head dim 256 on Hopper .* cuDNN"):
        run(checked)
