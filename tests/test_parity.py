"""Megatron (portable path, fp32, CPU) logits vs transformers logits, and HF -> Megatron -> HF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gpu_checks import FP32_MEAN_ABS, fp32_max_abs, fp32_router
from models import CONFIGS, YARN_SEQ, batch, hf_logits
from safetensors.torch import load_file

import twinkle_specs as ts

TOL = 1e-4  # max |Δ| of fp32 logits (measured: 0.0 on torch 2.13 CPU for every architecture, YaRN included)
# On a GPU, TE (TF32 GEMMs) against the fp32 CPU reference takes test_gpu_parity's bounds (gpu_checks): max
# |Δ| measured 2.6e-3 at TP=2 and EP=2 on H200 (core 0.16.1). MoE models run their router in fp64 and take the
# looser max: on core 0.19 (H200) Qwen3-MoE at EP=2 measured max |Δ| 0.103 with the fp32 router. The batch has
# a near-tie: one token's second and third experts are 5.6e-4 apart in the last layer's fp32 router logits,
# and rounding every GEMM's inputs to TF32 on the CPU puts the largest error (2.3e-3) at that token; a flipped
# expert there is the suspect.
WORKER = Path(__file__).parent / "dist_worker.py"


def _load_all(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out |= load_file(f)
    return out


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_logits_match_transformers(kind, checkpoints, megatron_single):
    hf = checkpoints(kind)
    tokens = batch(s=YARN_SEQ if "yarn" in kind else 32)  # YaRN: 3x past original_max_position_embeddings
    model = ts.build_model(hf).eval()
    with torch.no_grad():
        ours = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)[
            ..., : CONFIGS[kind]().vocab_size
        ]
    ref = hf_logits(hf, tokens)
    assert ref.abs().mean() > 0.05  # the reference is not degenerate
    assert (ours - ref).abs().max().item() <= TOL


LAYOUTS = [
    ("qwen3", 2, ["--tp", "2"]),
    ("qwen2", 2, ["--pp", "2"]),  # tied embeddings across pipeline stages
    ("qwen2_5", 2, ["--tp", "2"]),  # QKV bias split per query group
    ("qwen3_moe_nonorm", 2, ["--pp", "2"]),  # tied + MoE across stages
    ("qwen2_moe", 2, ["--pp", "2"]),  # shared expert + gate
    ("qwen3_moe", 2, ["--ep", "2"]),  # experts split over ranks (token dispatch on gloo: patches/)
    ("qwen2_moe", 2, ["--tp", "2"]),  # shared expert + gate under TP, experts over expert-TP
]
LAYOUT_IDS = [f"{kind}-{nproc}-layout{i}" for i, (kind, nproc, _) in enumerate(LAYOUTS)]


@pytest.fixture(scope="module")
def layouts(checkpoints, tmp_path_factory, request):
    """Every layout of the parametrized test below, run by dist_worker.py in one torchrun launch (see
    tests/dist_jobs.py); each test asserts on its own layout's outputs."""
    from dist_jobs import DistJobs

    jobs = DistJobs(WORKER, tmp_path_factory.mktemp("layouts"), request)
    for name, (kind, nproc, layout) in zip(LAYOUT_IDS, LAYOUTS, strict=True):
        jobs.add(name, nproc, _worker_args(checkpoints, kind, layout), test=f"{TEST}[{name}]")
    return jobs


TEST = "test_parallel_layouts_match_and_round_trip"


def _worker_args(checkpoints, kind, layout):
    gpu_router = fp32_router(kind, torch.float32) if torch.cuda.is_available() else {}
    router = [f"--{k.replace('_', '-')}={v}" for k, v in gpu_router.items()]
    return lambda out: ["--hf", str(checkpoints(kind)), "--out", str(out), *layout, *router]


@pytest.mark.parametrize("kind,nproc,layout", LAYOUTS, ids=LAYOUT_IDS)
def test_parallel_layouts_match_and_round_trip(kind, nproc, layout, checkpoints, layouts, request):
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        pytest.skip(f"on a GPU machine the layout runs one rank per GPU: needs {nproc} GPUs")
    out = layouts.out(request.node.callspec.id)
    _check_layout(kind, nproc, layout, checkpoints, out)


def _check_layout(kind, nproc, layout, checkpoints, out):
    """Asserts on the outputs ``out`` of dist_worker.py at ``layout`` on ``nproc`` ranks."""
    hf = checkpoints(kind)
    tokens = batch()
    ours = torch.load(out / "logits.pt")[..., : CONFIGS[kind]().vocab_size]
    gap = (ours.cpu() - hf_logits(hf, tokens)).abs()
    if not torch.cuda.is_available():
        assert gap.max().item() <= TOL
    else:
        assert gap.max().item() <= fp32_max_abs(kind), gap.max().item()
        assert gap.mean().item() <= FP32_MEAN_ABS, gap.mean().item()
    # Round trip: every tensor bit-exact, nothing added or lost.
    src, exported = _load_all(hf), _load_all(out / "export")
    assert sorted(src) == sorted(exported)
    for name, t in src.items():
        assert torch.equal(t, exported[name]), name
    # Megatron's own checkpoint (torch_dist) of this layout restores every parameter bit-exactly.
    for r in range(nproc):
        assert json.loads((out / f"dist-ckpt-{r}.json").read_text()) == {"mismatched": []}
    # Each rank read only its slices: with 2 ranks sharding the model, each reads less than all of it.
    if "--pp" in layout or "--tp" in layout:
        reads = [
            int((out / f"load-{r}.json").read_text().split('"bytes_read": ')[1].split(",")[0])
            for r in range(nproc)
        ]
        total = sum(t.numel() * t.element_size() for t in src.values())
        assert all(r < total for r in reads), (reads, total)
