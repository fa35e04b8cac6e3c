"""Where does a Qwen-MoE logit difference on the GPU come from? Builds one small Qwen3-MoE checkpoint and
compares the Transformer Engine path's fp32 logits with transformers under several MoE settings
(dispatcher, grouped GEMM, permute fusion, TF32 off), one line each. Used to compare megatron-core
versions on the GPU machine (core_v0.19 gave a larger fp32 MoE difference than core_v0.16.1):

    source /tmp/gpu/env19.sh && python3 scripts/gpu/diagnose_moe_parity.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

VARIANTS = {
    "default (alltoall, sequential experts)": {},
    "allgather dispatcher": {"moe_token_dispatcher_type": "allgather"},
    "grouped GEMM": {"moe_grouped_gemm": True},
    "permute fusion": {"moe_permute_fusion": True},
    "router in fp64": {"moe_router_dtype": "fp64"},
}


def main() -> None:
    import megatron.core
    from models import batch, make_checkpoint
    from transformers import AutoModelForCausalLM

    import twinkle_specs as ts
    from twinkle_specs.parity import _init_single_process, compare_logits

    _init_single_process()
    print(f"megatron-core {megatron.core.__version__} from {Path(megatron.core.__file__).parent}")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("qwen3_moe", "qwen2_moe"):
            hf = make_checkpoint(kind, Path(tmp) / kind)
            tokens = batch(s=128).cuda()
            pos = torch.arange(tokens.shape[1], device="cuda").expand_as(tokens)
            with torch.no_grad():
                ref = (
                    AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).cuda().eval()(tokens).logits
                )
            for tf32 in (True, False):
                torch.backends.cuda.matmul.allow_tf32 = tf32
                torch.backends.cudnn.allow_tf32 = tf32
                for name, overrides in VARIANTS.items():
                    try:
                        model = ts.build_model(hf, parallel_output=False, **overrides).eval()
                        with torch.no_grad():
                            report = compare_logits(model(tokens, pos, None), ref)
                    except Exception as err:  # a setting this version lacks: say so, go on
                        report = f"failed: {type(err).__name__}: {str(err)[:160]}"
                    print(f"{kind:10s} tf32={tf32!s:5s} {name:40s} {report}", flush=True)


if __name__ == "__main__":
    main()
