"""Adapter-only distributed checkpoints (megatron-core ``dist_checkpointing``).

Only the LoRA factors are saved, each as a ShardedTensor with its own TP axis (see
``LoraLayerMixin.sharded_state_dict``), global layer and expert offsets, so a checkpoint saved at one
TP/PP/EP layout resumes at another. The frozen base is not saved: resume builds the model from the HF
base (``build_model(hf_dir, lora=...)``) and loads the adapters on top. megatron-core 0.16's
``torch_dist`` backend needs CUDA; on a CPU host the PEFT directory written by ``export_peft_adapter``
(gathered, layout-independent) is the adapter checkpoint, and ``load_peft_adapter`` resumes from it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core import dist_checkpointing

from ..parallel import is_adapter_param, model_chunks
from ..safe_load import load_dist_checkpoint


def adapters_only(state: dict) -> dict:
    """The LoRA-factor entries of a (sharded) state dict: what an adapter-only checkpoint holds."""
    return {key: value for key, value in state.items() if is_adapter_param(key)}


def adapter_sharded_state_dict(model) -> dict:
    """The sharded state dict of the adapters only (chunk-prefixed ``model{i}.`` under virtual PP)."""
    chunks = model_chunks(model)
    out = {}
    for i, chunk in enumerate(chunks):
        prefix = f"model{i}." if len(chunks) > 1 else ""
        out.update({prefix + key: value for key, value in adapters_only(chunk.sharded_state_dict()).items()})
    if not out:
        raise ValueError(
            "the model has no LoRA factors: build it with build_model(hf_dir, lora=LoraConfig(...))"
        )
    return out


def save_adapter_checkpoint(model, ckpt_dir: str | Path) -> None:
    """Saves every rank's adapter shards to ``ckpt_dir`` (collective)."""
    ckpt_dir = Path(ckpt_dir)
    if torch.distributed.get_rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(adapter_sharded_state_dict(model), str(ckpt_dir))


def load_adapter_checkpoint(model, ckpt_dir: str | Path) -> None:
    """Loads adapter shards saved by :func:`save_adapter_checkpoint` (any layout) into this rank's model."""
    chunks = model_chunks(model)
    loaded = load_dist_checkpoint(adapter_sharded_state_dict(model), ckpt_dir)
    for i, chunk in enumerate(chunks):
        prefix = f"model{i}." if len(chunks) > 1 else ""
        params = dict(chunk.named_parameters())
        with torch.no_grad():
            for name, param in params.items():
                if is_adapter_param(name):
                    param.copy_(loaded[prefix + name])
