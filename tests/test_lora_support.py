"""Shared helpers of the LoRA tests (no tests here): tiny random Qwen checkpoints, PEFT references,
megatron parallel state for in-process tests, a gloo launcher for multi-rank workers, and the Triton
interpreter runner, launch counter and Hopper compile check of the kernel tests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import models
import pytest
import torch
from conftest import run_dist
from models import qwen_config

VOCAB = 128


def hf_config(kind: str):
    """The tests/models.py configs at LoRA-test size (vocab 128, 2 layers); ``qwen3_4l`` has 4 layers,
    enough for 2 pipeline stages of 2 virtual chunks."""
    return qwen_config(kind.removesuffix("_4l"), **_lora_size(kind))


def _lora_size(kind: str) -> dict:
    return dict(
        vocab_size=VOCAB, max_position_embeddings=128, num_hidden_layers=4 if kind.endswith("_4l") else 2
    )


def make_checkpoint(kind: str, out: Path, seed: int = 0) -> Path:
    """A random tiny HF checkpoint (weights scaled up so every tensor shows in the logits)."""
    return models.make_checkpoint(kind.removesuffix("_4l"), out, seed, **_lora_size(kind))


def hf_model(hf_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def randomize_peft(model, seed: int = 3, std: float = 0.1) -> None:
    """Non-zero A and B in a peft model, so the adapter changes every adapted output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def randomize_layer(layer, seed: int = 5, std: float = 0.3) -> None:
    """Non-zero factors in one LoRA layer, slot by slot: what a smaller rank's stacked B leaves unused
    stays zero, as in training."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for slot in layer.lora_slots:
            for which in "AB":
                f = layer.lora_factor(which, slot)
                f.copy_(torch.randn(f.shape, generator=g) * std)


def randomize_megatron(model, seed: int = 3, std: float = 0.1) -> None:
    """Non-zero factors in a Megatron LoRA model; the same seed on every rank keeps replicas equal."""
    from twinkle_specs.lora.peft_io import factors

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for f in factors(model):
            full = torch.randn(f.tensor.shape, generator=g) * std
            f.tensor.copy_(full)


def tokens(seed: int = 1, b: int = 2, s: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def megatron_logits(model, toks: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(toks.shape[1]).expand_as(toks)
    with torch.no_grad():
        return model(toks, pos, None)[..., :VOCAB]


@pytest.fixture(scope="module")
def single_rank():
    """megatron parallel state at world size 1 (gloo), for in-process tests."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        # An in-process store, as megatron_single's: no port held by this process and no MASTER_PORT left
        # in its environment, which the subprocesses of later tests (launchers) would inherit and clash on.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()


def run_ranks(nproc: int, script: Path, *args: str, timeout: int = 240) -> str:
    """Runs ``script`` on ``nproc`` gloo CPU ranks (GPUs hidden) with torchrun; returns its stdout."""
    return run_dist(nproc, script, *args, timeout=timeout, cpu_only=True).stdout


def interpreted(test_file: str) -> dict:
    """Runs ``test_file`` as a script under the Triton interpreter (``TRITON_INTERPRET=1``, GPUs hidden)
    and returns the JSON object its last output line holds (its kernels' errors)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, test_file], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def hopper_resources(kernel, constexprs: dict, options: dict, types: dict[str, str]) -> tuple[int, int]:
    """(registers per thread, spilled bytes) of a Triton kernel compiled for sm_90a (H100, H200) on this
    machine, by Triton and the ptxas it ships, with ``options`` (``num_warps``, ``num_stages``,
    ``maxnreg``) as launch keywords. Arguments not in ``constexprs``: ``types`` where given, else ``*bf16``
    for ``*_ptr`` and ``i32``; every pointer and integer divisible by 16, the specialisation the GPU gives
    the models' arguments, so ptxas reports what the device does (123 and 168 registers for two SwiGLU
    backward variants, as an H200 reported them)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = types.get(name, "*bf16" if name.endswith("_ptr") else "i32")
        if signature[name].startswith("*") or signature[name] == "i32":
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        args = [get_ptxas(90).path, "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "kernel.cubin")]
        report = subprocess.run(args, capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report)[1])
    return registers, sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))


class CountingKernel:
    """A Triton kernel whose launches (``kernel[grid](...)``) are counted."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def transformers4_adapter(hf, out, projs, r=4, alpha=8, expert_b_scale=0.1, edit=None):
    """A random adapter in the layout transformers 4 + peft saved for Qwen3-MoE, where each routed expert was
    its own gate_proj / up_proj / down_proj linear (``...mlp.experts.<e>.gate_proj.lora_A.weight``), with
    q_proj beside them. Each tensor's values follow from its name alone; ``expert_b_scale`` scales the
    experts' B (0: their adapters do nothing), ``edit`` changes the tensors before they are written."""
    import peft
    from safetensors.torch import save_file

    def rand(key: str, *shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(key.encode()))) * std

    tensors = {}
    for name, weight in hf_model(hf).named_parameters():
        if name.endswith("self_attn.q_proj.weight"):
            module = f"base_model.model.{name.removesuffix('.weight')}"
            tensors[f"{module}.lora_A.weight"] = rand(f"{module}.A", r, weight.shape[1])
            tensors[f"{module}.lora_B.weight"] = rand(f"{module}.B", weight.shape[0], r)
        if name.endswith("mlp.experts.gate_up_proj"):
            experts, width, hidden = weight.shape
            sizes = {"gate_proj": (hidden, width // 2), "up_proj": (hidden, width // 2)}
            sizes["down_proj"] = (width // 2, hidden)
            for e in range(experts):
                for proj in projs:
                    module = f"base_model.model.{name.removesuffix('gate_up_proj')}{e}.{proj}"
                    fan_in, fan_out = sizes[proj]
                    tensors[f"{module}.lora_A.weight"] = rand(f"{module}.A", r, fan_in)
                    tensors[f"{module}.lora_B.weight"] = rand(f"{module}.B", fan_out, r, std=expert_b_scale)
    if edit:
        edit(tensors)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=["q_proj", *projs], task_type="CAUSAL_LM")
    config.save_pretrained(out)
    return out
