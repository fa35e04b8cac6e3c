"""Writes a megatron-core Qwen model, in any TP/PP/EP layout, back to a Hugging Face checkpoint.

Every rank takes part: tensor-parallel shards are gathered inside their (expert-)TP group, the
group's owner (TP rank 0 of data-parallel replica 0) turns them into HF tensors with the same layouts
the loader uses, and sends them to global rank 0, which writes safetensors shards one at a time. The
shard plan is fixed before any data moves, so rank 0 never holds more than one shard.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from safetensors.torch import save_file

from .checkpoint import INDEX_NAME, CheckpointReader
from .hf_config import QwenArch, qwen_arch_from_hf
from .left_alone import left_alone
from .output_dir import staged_output
from .parallel import bindings, model_chunks, tp_info
from .weight_map import hf_tensor_shapes

# Files besides the weights that make the output a usable HF checkpoint, copied from the source.
_COPIED = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
# What an earlier export into the same directory may hold: an overwrite replaces exactly these.
HF_OUTPUTS = ("*.safetensors", INDEX_NAME, "config.json", *_COPIED)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _in_owner_group(expert: bool) -> bool:
    """Data-parallel replica 0 (of the expert-data-parallel group for experts) exports its shards."""
    if not ps.model_parallel_is_initialized():
        return True
    return (ps.get_expert_data_parallel_rank() if expert else ps.get_data_parallel_rank()) == 0


def _is_owner(expert: bool) -> bool:
    """TP rank 0 of the owner group sends a parameter's HF tensors to the writer."""
    return _in_owner_group(expert) and tp_info(expert).rank == 0


def _gather(param: torch.Tensor, expert: bool) -> list[torch.Tensor]:
    info = tp_info(expert)
    local = param.detach()
    if info.size == 1:
        return [local]
    shards = [torch.empty_like(local) for _ in range(info.size)]
    dist.all_gather(shards, local.contiguous(), group=info.group)
    return shards


def _source(model, hf_dir: str | Path | None) -> Path:
    if hf_dir is not None:
        return Path(hf_dir)
    src = getattr(model_chunks(model)[0], "hf_source_dir", None)
    if src is None:
        raise ValueError("save_hf_weights: the model has no recorded HF source; pass hf_dir=<checkpoint dir>")
    return Path(src)


def _owned_tensors(model, arch: QwenArch, dtype: torch.dtype):
    """Yields (hf_name, tensor) for every HF tensor this rank owns, in order. The other TP ranks of an
    owner group walk the same sequence, taking part in the gathers and yielding nothing."""
    for binding, param in bindings(model, arch):
        if not _in_owner_group(binding.expert):
            continue
        shards = _gather(param, binding.expert)
        if not _is_owner(binding.expert):
            continue
        for name, tensor in binding.layout.export(shards, binding.hf_names).items():
            yield name, tensor.to(dtype).contiguous()


def save_hf_weights(
    model,
    out_dir: str | Path,
    *,
    hf_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2 * 2**30,
    overwrite: bool = False,
) -> None:
    """Writes ``model`` (this rank's stage; call on every rank) as an HF checkpoint in ``out_dir``.

    ``hf_dir`` is the source checkpoint (config.json, tokenizer); by default the one the weights were
    loaded from. ``dtype`` defaults to the source config's dtype, so HF -> Megatron -> HF is bit-exact.
    ``out_dir`` must be new or empty (``overwrite`` replaces an earlier export there) and apart from the
    source; it appears complete or not at all (:mod:`twinkle_specs.output_dir`).
    """
    src = _source(model, hf_dir)
    recorded = getattr(model_chunks(model)[0], "hf_source_dir", None)
    with staged_output(
        out_dir,
        sources={"the source checkpoint": src, "the checkpoint the model was loaded from": recorded},
        overwrite=overwrite,
        replaceable=HF_OUTPUTS,
    ) as staging:
        _write_hf(model, staging, src, dtype, max_shard_bytes)


def _write_hf(model, out: Path, src: Path, dtype: torch.dtype | None, max_shard_bytes: int) -> None:
    """The streaming write of :func:`save_hf_weights` into an existing empty directory (rank 0's)."""
    arch = qwen_arch_from_hf(src)
    dtype = dtype or _DTYPES.get(arch.dtype or "", None) or next(model_chunks(model)[0].parameters()).dtype
    rank = dist.get_rank() if _distributed() else 0
    world = dist.get_world_size() if _distributed() else 1

    # 1. Plan: which rank produces which tensor (name, shape), in production order.
    shapes = hf_tensor_shapes(arch)
    mine = [b.hf_names for b, _ in bindings(model, arch) if _is_owner(b.expert)]
    mine_flat = [n for names in mine for n in names]
    plans: list[list[str]] = [mine_flat]
    if world > 1:
        plans = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(plans, mine_flat)
    order: list[tuple[str, int]] = []
    seen: set[str] = set()
    for owner, names in enumerate(plans):
        for n in names:
            if n not in seen:  # a tied embedding is held by the first and the last stage
                seen.add(n)
                order.append((n, owner))
    missing = sorted(set(shapes) - seen)
    if missing:
        raise RuntimeError(f"save_hf_weights: no rank holds {missing[:5]}; was every pipeline stage built?")

    # 2. Shard plan, fixed up front so file names and the index are known before data moves.
    itemsize = torch.tensor([], dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for name, _ in order:
        nbytes = itemsize * int(torch.Size(shapes[name]).numel())
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    # Tensors a named rule leaves alone (vision tower, MTP head) follow in their own shards, as read.
    with CheckpointReader(src) as reader:
        left = {n: reader.nbytes(n) for n in sorted(left_alone(reader.keys(), arch))}
    first_left = len(shards)
    if left:
        shards.append([])
        size = 0
    for name, nbytes in left.items():
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    shard_of = {n: i for i, names in enumerate(shards) for n in names}

    # 3. Stream: owners send, rank 0 receives in plan order and writes each shard when complete.
    owner_of = dict(order)
    produced = _owned_tensors(model, arch, dtype)
    pending: dict[str, torch.Tensor] = {}
    # NCCL moves device tensors only; gloo moves host tensors.
    comm = (
        torch.device("cuda", torch.cuda.current_device())
        if world > 1 and dist.get_backend() == "nccl"
        else None
    )
    if rank != 0:
        for name, tensor in produced:
            if owner_of.get(name) == rank:
                dist.send(tensor.to(comm) if comm else tensor.cpu(), dst=0)
    else:
        remaining = {i: set(names) for i, names in enumerate(shards)}
        buffer: dict[str, torch.Tensor] = {}
        for name, owner in order:
            if owner == 0:
                while name not in pending:
                    n, t = next(produced)
                    if owner_of.get(n) == 0:
                        pending[n] = t
                tensor = pending.pop(name)
            else:
                tensor = torch.empty(shapes[name], dtype=dtype, device=comm)
                dist.recv(tensor, src=owner)
            buffer[name] = tensor.cpu()
            i = shard_of[name]
            remaining[i].discard(name)
            if not remaining[i]:
                save_file(
                    {n: buffer.pop(n) for n in shards[i]}, str(out / files[i]), metadata={"format": "pt"}
                )
        for _ in produced:  # rank 0's generator may still hold duplicates (tied weights)
            pass
        if left:
            with CheckpointReader(src) as reader:
                for i in range(first_left, len(shards)):
                    tensors = {n: reader.read(n, None, None) for n in shards[i]}
                    save_file(tensors, str(out / files[i]), metadata={"format": "pt"})
        total = sum(itemsize * int(torch.Size(shapes[n]).numel()) for n, _ in order) + sum(left.values())
        (out / INDEX_NAME).write_text(
            json.dumps(
                {
                    "metadata": {"total_size": total},
                    "weight_map": {n: files[i] for n, i in sorted(shard_of.items())},
                },
                indent=2,
            )
        )
        config = json.loads((src / "config.json").read_text())
        config["dtype"] = str(dtype).replace("torch.", "")
        config.pop("torch_dtype", None)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        for extra in _COPIED:
            if (src / extra).is_file():
                shutil.copy2(src / extra, out / extra)
