"""One gloo CPU rank of tests/test_lora_fused.py's TP=2 test (run by torchrun; no tests here).

Builds portable LoRA linears at TP=2 (optionally with sequence parallelism), runs the fused adapter
and the per-slot reference on the same input and output gradient, and writes (rank<N>.json in --out)
per case the largest |Δ| over output, input gradient and factor gradients, relative to the reference's
largest value; without sequence parallelism likewise for the layer's whole forward (``<case>-forward``).
With ``--jobs FILE`` it runs several such jobs in turn in one process group (tests/dist_jobs.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from dist_jobs import run_jobs  # this script's folder (tests/) is on sys.path


def main() -> None:
    import twinkle_specs

    twinkle_specs.apply_patches()  # megatron's TP gathers allocate on CUDA without them
    dist.init_process_group("gloo")
    run_jobs(_job, sys.argv[1:])
    dist.destroy_process_group()


def _job(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sp", action="store_true")
    args = ap.parse_args(argv)

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from test_lora_fused import S, _config, _portable, _rel, _run

    ps.initialize_model_parallel(2, 1)
    tp, rank = 2, ps.get_tensor_model_parallel_rank()
    config = _config(sequence_parallel=args.sp, tensor_model_parallel_size=tp)
    cases = {
        "qkv-gqa-full": (
            "linear_qkv",
            dict(q_proj=S(4, 8, False), k_proj=S(4, 8, False), v_proj=S(4, 8, False)),
        ),
        "qkv-q-v-ranks": ("linear_qkv", dict(q_proj=S(6, 8, False), v_proj=S(2, 8, True))),
        "fc1-ranks": ("linear_fc1", dict(gate_proj=S(2, 4, False), up_proj=S(6, 6, False))),
        "fc1-up": ("linear_fc1", dict(up_proj=S(4, 8, False))),
        "proj-row": ("linear_proj", dict(o_proj=S(4, 8, False))),
    }
    from test_lora_fused import SIZES

    worst = {}
    for name, (site, slots) in cases.items():
        torch.manual_seed(0)  # same replicated factors on both ranks
        layer = _portable(site, slots, config=config)
        n_in, n_out = SIZES[site]
        row = site in ("linear_proj", "linear_fc2")
        g = torch.Generator().manual_seed(1)
        x = torch.randn(8, 2, n_in, generator=g)
        grad = torch.randn(8, 2, n_out, generator=g)
        # this rank's input and output-gradient shards (row: input columns; SP: sequence)
        x = x.chunk(tp, dim=-1)[rank] if row else (x.chunk(tp, dim=0)[rank] if args.sp else x)
        grad = (grad.chunk(tp, dim=0)[rank] if args.sp else grad) if row else grad.chunk(tp, dim=-1)[rank]
        fused = _run(layer, layer.lora_delta, x, grad)
        ref = _run(layer, layer.lora_delta_per_slot, x, grad)
        assert fused[0].shape == grad.shape, (name, fused[0].shape, grad.shape)
        worst[name] = _rel(fused, ref)
        if args.sp:  # megatron's sequence-parallel base linears allocate CUDA buffers: no base on CPU
            continue
        # the layer's forward (base + lora_down/lora_up) vs the base's own forward + the reference
        base = (RowParallelLinear if row else ColumnParallelLinear).forward
        got = _run(layer, lambda x: layer(x)[0], x, grad)  # noqa: B023
        want = _run(layer, lambda x: base(layer, x)[0] + layer.lora_delta_per_slot(x), x, grad)  # noqa: B023
        worst[f"{name}-forward"] = _rel(got, want)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(worst))
    dist.barrier()  # every rank leaves together (a gloo group torn down mid-talk aborts its peer)
    ps.destroy_model_parallel()


if __name__ == "__main__":
    main()
