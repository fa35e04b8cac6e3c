"""HF -> Megatron load on several ranks: seconds and bytes each rank reads vs the checkpoint's size.

    torchrun --nproc-per-node 2 bench/load.py --hf DIR --tp 2 --out load.json

``bench/run.py --load-layouts tp2,pp2`` runs this after a shape's variants (gloo on CPU by default, so
it needs no second GPU: the bytes a rank reads do not depend on the device; the seconds are for the
portable path's CPU parameters). With ``--on-gpu`` each rank uses its own GPU (NCCL, TE).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def layout_sizes(layout: str) -> dict[str, int]:
    """'tp2pp2' -> {'tp': 2, 'pp': 2, 'ep': 1}; the product is the number of ranks."""
    import re

    sizes = {"tp": 1, "pp": 1, "ep": 1}
    parts = re.findall(r"(tp|pp|ep)(\d+)", layout)
    if not parts or "".join(f"{k}{v}" for k, v in parts) != layout:
        raise ValueError(f"layout {layout!r}: expected e.g. tp2, pp2, tp2pp2, ep2")
    for k, v in parts:
        sizes[k] = int(v)
    return sizes


def world_size(layout: str) -> int:
    """Ranks for a layout: TP x PP x DP with DP = EP (expert TP = TP)."""
    s = layout_sizes(layout)
    return s["tp"] * s["pp"] * s["ep"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True, type=Path)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import twinkle_specs as ts
    from bench.load_timing import drop_page_cache

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    sizes = layout_sizes(args.layout)
    ps.initialize_model_parallel(sizes["tp"], sizes["pp"], expert_model_parallel_size=sizes["ep"])
    if on_gpu:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    from twinkle_specs.hf_config import qwen_arch_from_hf

    dtype = torch.bfloat16 if qwen_arch_from_hf(args.hf).dtype == "bfloat16" else torch.float32
    model = ts.build_model(args.hf, load_weights=False, params_dtype=dtype, bf16=dtype == torch.bfloat16)
    dropped = drop_page_cache(sorted(args.hf.glob("*.safetensors"))) if dist.get_rank() == 0 else None
    dist.barrier()
    t0 = time.perf_counter()
    report = ts.load_hf_weights(model, args.hf)
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    dist.barrier()
    all_seconds = time.perf_counter() - t0
    row = {
        "rank": dist.get_rank(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "seconds": seconds,
        "bytes_read": report.bytes_read,
        "checkpoint_bytes": report.checkpoint_bytes,
        "read_fraction": report.bytes_read / report.checkpoint_bytes,
        "parameters": report.parameters,
    }
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        ckpt = rows[0]["checkpoint_bytes"]
        out = {
            "layout": args.layout,
            "ranks": len(rows),
            "device": torch.cuda.get_device_name() if on_gpu else "cpu",
            "impl": model.config.transformer_impl,
            "checkpoint_bytes": ckpt,
            "seconds_all_ranks": all_seconds,
            "max_bytes_read_per_rank": max(r["bytes_read"] for r in rows),
            "max_read_fraction_per_rank": max(r["read_fraction"] for r in rows),
            "total_read_fraction": sum(r["bytes_read"] for r in rows) / ckpt,
            "page_cache_dropped": dropped,
            "per_rank": rows,
        }
        args.out.write_text(json.dumps(out, indent=1))
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
