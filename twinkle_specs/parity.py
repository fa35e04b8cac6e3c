"""Compares megatron-core logits with transformers logits for one checkpoint (the parity report)."""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import torch

DEFAULT_CONFIG = "defaults/qwen3-tiny/config.json"


@dataclass
class ParityReport:
    max_abs: float
    mean_abs: float
    cosine: float
    argmax_agreement: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"max |Δ| {self.max_abs:.3e}  mean |Δ| {self.mean_abs:.3e}  cosine {self.cosine:.6f}  "
            f"argmax agreement {self.argmax_agreement:.4f}"
        )


def compare_logits(ours: torch.Tensor, ref: torch.Tensor) -> ParityReport:
    """Statistics of two [b, s, vocab] logit tensors (ours may carry padded vocabulary columns)."""
    ours, ref = ours[..., : ref.shape[-1]].float().cpu(), ref.float().cpu()
    diff = (ours - ref).abs()
    cos = torch.nn.functional.cosine_similarity(ours.flatten(0, 1), ref.flatten(0, 1), dim=-1).mean()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean()
    return ParityReport(diff.max().item(), diff.mean().item(), cos.item(), agree.item())


def make_default_checkpoint(out: Path, seed: int = 0) -> Path:
    """The embedded default: a small Qwen3 from the bundled config.json, random weights, as safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_file = resources.files("twinkle_specs").joinpath(DEFAULT_CONFIG)
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(str(Path(str(config_file)).parent))
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def _init_single_process() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        # An in-process store: no port to pick, and no clash with the MASTER_ADDR/MASTER_PORT of a
        # torchrun or Slurm job this tool may be started inside (they name the job's rendezvous).
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
        if torch.cuda.is_available():
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(0)


def run_parity(
    hf_dir: str | Path | None = None, *, seq_len: int = 64, batch: int = 2, dtype: torch.dtype = torch.float32
) -> tuple[ParityReport, Path]:
    """Loads ``hf_dir`` (default: the embedded small Qwen3) into megatron-core on one process and
    compares its logits with transformers' on the same random tokens."""
    from transformers import AutoModelForCausalLM

    from .model import build_model

    tmp = None
    if hf_dir is None:
        tmp = tempfile.mkdtemp(prefix="twinkle-parity-")
        hf_dir = make_default_checkpoint(Path(tmp) / "qwen3-tiny")
    hf_dir = Path(hf_dir)
    _init_single_process()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(
        hf_dir, params_dtype=dtype, bf16=dtype == torch.bfloat16, parallel_output=False
    ).eval()
    ref_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, ref_model.config.vocab_size, (batch, seq_len), generator=g).to(device)
    with torch.no_grad():
        ours = model(tokens, torch.arange(seq_len, device=device).expand_as(tokens), None)
        ref = ref_model(tokens).logits
    return compare_logits(ours, ref), hf_dir
