"""Exchange of LoRA adapters with Hugging Face PEFT (adapter_config.json + adapter_model.safetensors).

Names come from :mod:`twinkle_specs.weight_map` (``bind`` gives each Megatron linear its HF tensors,
with global layer and expert indices), so a slot ``q_proj`` of ``decoder.layers.3.self_attention
.linear_qkv`` becomes ``base_model.model.model.layers.<global 3>.self_attn.q_proj.lora_A.weight``.
Every slot's factors are contiguous blocks of the PEFT tensors on each TP rank (B rows for
column-parallel bases, A columns for row-parallel ones), which is how Megatron shards the base weights.

Routed experts use peft's ``target_parameters`` layout on transformers' fused expert tensors (what vLLM
reads for MoE LoRA too): ``lora_A`` is [r * E, in] (expert-major), ``lora_B`` is [out, r * E]
(rank-major, expert-minor); with both expert parameters targeted, peft nests its wrappers and the
gate_up_proj factors sit under ``experts.base_layer``. An export may instead write them per expert, as
transformers 4 named them (``...mlp.experts.<e>.gate_proj.lora_A.weight``; ``expert_layout="per-expert"``):
what transformers 4 + peft load, and what vLLM reads without options for the models it does not flag
``is_3d_moe_weight`` (Qwen3-MoE, Qwen3-Next).

Hybrid models reorder rows between transformers and Megatron (the gated attention's q_proj: query and
gate per head, Megatron: all queries then all gates per group; the Gated DeltaNet's in_proj: sections
per TP rank, Qwen3-Next's per key head). A slot's B rows then follow the base weight's own layout
(:func:`_peft_rows`, from the weight map's GatedQKV / GDNInProj), so adapters move like the weights.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from safetensors import safe_open
from safetensors.torch import save_file

from ..hf_config import qwen_arch_from_hf
from ..output_dir import staged_output
from ..parallel import model_chunks
from ..weight_map import bind
from .config import EXPERT_LAYOUTS, LoraConfig, Sites, pattern_path, slot_path
from .layers import LoraLayerMixin
from .model import lora_modules
from .peft_experts import fuse_per_expert, split_experts, stack_experts
from .spec import fused_experts, lora_in_proj

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# What an earlier adapter export into the same directory may hold: an overwrite replaces exactly these.
PEFT_OUTPUTS = (ADAPTER_WEIGHTS, ADAPTER_CONFIG, "README.md")
PREFIX = "base_model.model."


@dataclass(frozen=True)
class Factor:
    """One factor of one slot on this rank, with where it lives in the PEFT file."""

    layer: LoraLayerMixin  # the linear that owns the factor
    which: str  # "A" or "B"
    index: tuple  # this factor's block of the linear's lora_A/lora_B (the local expert first for grouped experts)
    key: str  # PEFT tensor name
    tp_dim: int | None  # dimension split over TP ranks, None when replicated
    expert: int | None  # global expert index for routed experts (PEFT stacks them)
    num_experts: int
    # PEFT rows of B in this rank's order, and of all TP ranks in gather order (None: contiguous blocks)
    rows: tuple[torch.Tensor, torch.Tensor] | None = None
    slot: str = ""  # the HF projection (gate_up_proj and down_proj share a key when only one is adapted)

    @property
    def tensor(self) -> torch.Tensor:
        return self.layer.lora_param(self.which)[self.index]

    @property
    def grad(self) -> torch.Tensor | None:
        g = self.layer.lora_leaf(self.which).grad
        return None if g is None else self.layer.lora_view(self.which, g)[self.index]


def _lora_config(model) -> LoraConfig:
    config = getattr(model_chunks(model)[0].config, "lora", None)
    if config is None:
        raise ValueError(
            "the model has no LoRA config: build it with build_model(hf_dir, lora=LoraConfig(...))"
        )
    return config


def model_sites(model) -> Sites:
    """The sites, slots and ranks this model actually adapts (a config may name absent experts)."""
    return {layer.lora_site: dict(layer.lora_spec) for _, _, layer in lora_modules(model)}


def resolve_for(model, lora: LoraConfig) -> Sites:
    """What ``lora`` means on this model (the spec resolves it the same way when building layers)."""
    config = model_chunks(model)[0].config
    return lora.resolve(
        fused_experts=fused_experts(config),
        shared_expert=bool(config.moe_shared_expert_intermediate_size),
        num_layers=config.num_layers,
        in_proj=lora_in_proj(config),
    )


def _hf_source(model) -> str:
    src = getattr(model_chunks(model)[0], "hf_source_dir", None)
    if src is None:
        raise ValueError(
            "the model does not know its Hugging Face base (load_hf_weights sets it): build it with "
            "build_model(hf_dir, lora=...) so adapters can be named after the HF model"
        )
    return src


def factors(model) -> Iterator[Factor]:
    """Every adapter factor of this rank with its PEFT name and layout."""
    arch = qwen_arch_from_hf(_hf_source(model))
    expert_sites = {s for s in model_sites(model) if s.startswith("experts.")}
    ep_rank = ps.get_expert_model_parallel_rank()
    local_experts = (arch.num_experts or 0) // ps.get_expert_model_parallel_world_size()
    chunks = model_chunks(model)
    for index, name, layer in lora_modules(model):
        chunk = chunks[index]
        layers = chunk.decoder.layers

        def global_layer(i: int, layers=layers) -> int:
            return layers[i].layer_number - 1

        gemms = range(layer.lora_num_gemms) if layer.lora_num_gemms else [None]
        for gemm in gemms:
            weight_name = f"{name}.weight" if gemm is None else f"{name}.weight{gemm}"
            binding = bind(
                weight_name, arch, chunk.vocab_size, global_layer, lambda e: ep_rank * local_experts + e
            )
            yield from _slot_factors(
                layer, binding.hf_names, gemm, expert_sites, arch.num_experts or 0, binding.layout
            )


def _peft_rows(layout, hf_names, slot: str, rank: int, size: int) -> torch.Tensor | None:
    """The rows of ``slot``'s PEFT B that TP rank ``rank`` holds, in Megatron's order, where the base
    weight's layout reorders rows (the weight map's GatedQKV, GDNInProj); None where they are a plain
    contiguous block. Found by running the layout's own loader on row numbers."""
    from ..weight_map_hybrid import GatedQKV, GDNInProj

    if not isinstance(layout, GatedQKV | GDNInProj):
        return None
    stride = 1 << 32
    index = {name: i for i, name in enumerate(hf_names)}

    def read(name: str, rows: tuple[int, int], cols: None) -> torch.Tensor:
        return (index[name] * stride + torch.arange(*rows)).view(-1, 1)

    ids = layout.load(read, hf_names, rank, size).view(-1)
    (mine,) = [i for i, n in enumerate(hf_names) if n.split(".")[-2] == slot]
    return ids[ids // stride == mine] % stride


def _slot_factors(
    layer: LoraLayerMixin, hf_names, gemm, expert_sites, num_experts, layout=None
) -> Iterator[Factor]:
    column = layer.lora_parallel == "column"
    tp_dims = {"A": None if column else 1, "B": 0 if column else None} if layer.lora_tp_size > 1 else {}
    for slot in layer.lora_slots:
        if layer.lora_site.startswith("experts."):
            # model.layers.L.mlp.experts.E.gate_proj.weight -> model.layers.L.mlp.experts, expert E
            parts = hf_names[0].split(".")
            module, expert = ".".join(parts[:-3]), int(parts[-3])
            nested = slot == "gate_up_proj" and len(expert_sites) == 2
            base = f"{PREFIX}{module}{'.base_layer' if nested else ''}"
        else:
            (hf,) = [n for n in hf_names if n.split(".")[-2] == slot]
            base, expert = f"{PREFIX}{hf.removesuffix('.weight')}", None
        rows = None
        if column and _peft_rows(layout, hf_names, slot, 0, 1) is not None:
            size, rank = (
                layer.lora_tp_size,
                ps.get_tensor_model_parallel_rank() if layer.lora_tp_size > 1 else 0,
            )
            per_rank = [_peft_rows(layout, hf_names, slot, r, size) for r in range(size)]
            rows = (per_rank[rank], torch.cat(per_rank))
        for which in "AB":
            yield Factor(
                layer,
                which,
                (() if gemm is None else (gemm,)) + layer.lora_factor_index(which, slot),
                f"{base}.lora_{which}.weight",
                tp_dims.get(which),
                expert,
                num_experts,
                rows if which == "B" else None,
                slot,
            )


def _gather_tp(t: torch.Tensor, dim: int) -> torch.Tensor:
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def gather_peft_tensors(
    model, grads: bool = False, expert_layout: str = "fused"
) -> dict[str, torch.Tensor] | None:
    """Every factor (or its gradient) under its PEFT name, full size, on global rank 0 (None elsewhere);
    routed experts in ``expert_layout`` (one of :data:`EXPERT_LAYOUTS`).

    Collective over all ranks: shards are gathered over TP, stages and experts over PP and EP.
    """
    local: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}  # (key, slot, which) -> expert: factor
    num_experts = 0
    for f in factors(model):
        t = (f.grad if grads else f.tensor).detach()
        if f.tp_dim is not None:
            t = _gather_tp(t, f.tp_dim)
        if f.rows is not None:  # Megatron's row order -> PEFT's (the row index lives on the host)
            t = t.cpu()
            t = torch.empty_like(t).index_copy_(0, f.rows[1], t)
        if f.expert is None:
            local[f.key] = t.cpu()
        else:
            experts.setdefault((f.key, f.slot, f.which), {})[f.expert] = t.cpu()
            num_experts = f.num_experts
    gathered: list = [(local, experts, num_experts)]
    if dist.is_initialized():
        rank0 = dist.get_rank() == 0
        gathered = [None] * dist.get_world_size() if rank0 else None
        dist.gather_object((local, experts, num_experts), gathered, dst=0)
        if not rank0:
            return None
    tensors: dict[str, torch.Tensor] = {}
    all_experts: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    for rank_local, rank_experts, rank_num in gathered:
        tensors |= rank_local
        num_experts = max(num_experts, rank_num)
        for key, per in rank_experts.items():
            all_experts.setdefault(key, {}).update(per)
    for (key, slot, which), per in all_experts.items():
        if expert_layout == "per-expert":
            tensors |= split_experts(per, which, key, slot, num_experts)
        else:
            tensors[key] = stack_experts(per, which, key, num_experts)
    return tensors


def export_peft_adapter(
    model,
    out_dir: str | Path,
    base_model_name_or_path: str | None = None,
    *,
    overwrite: bool = False,
    expert_layout: str = "fused",
) -> Path | None:
    """Writes the adapters as a PEFT adapter directory that ``PeftModel.from_pretrained`` loads.

    Collective: every rank of the model's parallel layout must call it; global rank 0 writes and
    returns the directory. The file holds the factors in the model's parameter dtype. ``out_dir`` must be
    new or empty (``overwrite`` replaces an earlier adapter there) and apart from the base checkpoint; it
    appears complete or not at all (:mod:`twinkle_specs.output_dir`). ``expert_layout``: routed experts in
    peft's ``target_parameters`` layout (``"fused"``, transformers 5) or per expert (``"per-expert"``,
    transformers 4's names; Qwen3-MoE and Qwen3-Next, see :func:`check_expert_layout`).
    """
    lora = _lora_config(model)
    sites = model_sites(model)
    check_expert_layout(model, expert_layout)
    base = base_model_name_or_path or _hf_source(model)
    sources = {
        "the base checkpoint": base if Path(base).is_dir() else None,  # not a hub name
        "the checkpoint the model was loaded from": _hf_source(model),
    }
    with staged_output(out_dir, sources=sources, overwrite=overwrite, replaceable=PEFT_OUTPUTS) as staging:
        tensors = gather_peft_tensors(model, expert_layout=expert_layout)
        if tensors is not None:
            save_file(
                {k: v.contiguous() for k, v in sorted(tensors.items())},
                staging / ADAPTER_WEIGHTS,
                {"format": "pt"},
            )
            shared = bool(model_chunks(model)[0].config.moe_shared_expert_intermediate_size)
            write_peft_config(_peft_config(lora, sites, shared, base, expert_layout), staging)
    return Path(out_dir) if tensors is not None else None


def check_expert_layout(model, expert_layout: str) -> None:
    """Refuses an ``expert_layout`` this model's adapters cannot be written in, before anything is gathered.

    Per expert needs what transformers 4's names can say and peft 0.21 reads back the same: a model whose
    routed experts those names mean (Qwen3-MoE, Qwen3-Next: :func:`~twinkle_specs.lora.spec.fused_experts`),
    no other MLP adapted (``gate_proj`` would also name the shared expert), the experts at the config's rank
    and alpha (peft's conversion gives gate_up rank 2r and alpha 2 alpha from the config's) and no rsLoRA
    (that conversion changes its scale, alpha / sqrt(r))."""
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout {expert_layout!r}: expected one of {', '.join(EXPERT_LAYOUTS)}")
    sites = model_sites(model)
    experts = {s for s in sites if s.startswith("experts.")}
    if expert_layout == "fused" or not experts:
        return
    lora, config = _lora_config(model), model_chunks(model)[0].config
    why = None
    if not fused_experts(config):
        why = "its HF model has no transformers 4 per-expert names that peft maps to the routed experts"
    elif {"linear_fc1", "linear_fc2"} & set(sites):
        why = (
            "its shared expert (or dense MLP) is adapted too, and gate_proj/up_proj/down_proj would name both"
        )
    elif lora.use_rslora:
        why = "peft's conversion back to transformers 5 (rank 2r, alpha 2 alpha) changes an rsLoRA adapter's scale"
    else:
        odd = [
            f"{site}.{slot} r={spec.r} alpha={spec.lora_alpha}"
            for site in sorted(experts)
            for slot, spec in sites[site].items()
            if (spec.r, spec.lora_alpha) != (lora.r, lora.lora_alpha)
        ]
        if odd:
            why = (
                f"routed experts must have the config's r={lora.r} and alpha={lora.lora_alpha} ({'; '.join(odd)}; "
                "HF MLP names give gate_up rank 2r as peft does, Megatron's linear_fc1/linear_fc2 rank r)"
            )
    if why:
        raise ValueError(
            f"expert_layout 'per-expert': {why}; export the routed experts in peft's fused layout "
            "(expert_layout 'fused', the default)"
        )


def write_peft_config(config: Any, directory: Path) -> None:
    """``config.save_pretrained(directory)`` with the fields peft keeps as sets (``target_modules``...)
    sorted: peft writes them in hash order, which changes from one process to the next, so the same adapter
    would not give the same adapter_config.json twice."""
    config.save_pretrained(str(directory))
    path = directory / ADAPTER_CONFIG
    fields = json.loads(path.read_text())
    for key, value in vars(config).items():
        if isinstance(value, set) and isinstance(fields.get(key), list):
            fields[key] = sorted(fields[key])
    path.write_text(json.dumps(fields, indent=2, sort_keys=True))


def _peft_config(
    lora: LoraConfig, sites: Sites, shared_expert: bool, base: str, expert_layout: str = "fused"
):
    """peft's config for exactly these sites: explicit names (never 'all-linear'), per-path ranks."""
    import peft

    modules, parameters, ranks, alphas = set(), set(), {}, {}
    for site, slots in sites.items():
        for slot, spec in slots.items():
            path = slot_path(site, slot, shared_expert)
            if site.startswith("experts.") and expert_layout == "per-expert":
                modules.update(("gate_proj", "up_proj") if slot == "gate_up_proj" else (slot,))
                continue  # at the config's rank and alpha (check_expert_layout)
            if site.startswith("experts."):
                parameters.add(path)
            elif site == "router":
                parameters.add(f"{path}.weight")
            else:
                modules.add(slot)
            key = rf".*\.{re.escape(pattern_path(site, slot, shared_expert))}"
            if spec.r != lora.r:
                ranks[key] = spec.r
            if spec.lora_alpha != lora.lora_alpha:
                alphas[key] = spec.lora_alpha
    return peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.lora_alpha,
        rank_pattern=ranks,
        alpha_pattern=alphas,
        lora_dropout=lora.lora_dropout,
        use_rslora=lora.use_rslora,
        target_modules=sorted(modules) or None,
        target_parameters=sorted(parameters) or None,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )


def load_peft_adapter(model, adapter_dir: str | Path) -> None:
    """Loads a PEFT LoRA adapter (made by peft or :func:`export_peft_adapter`) into this rank's factors.
    Routed experts may also be in the per-expert layout of transformers 4 (:mod:`.peft_experts`).

    The model must have been built with the adapter's configuration (``LoraConfig.from_peft(dir)``);
    every tensor of the file must be used and have the shape this base model implies.
    """
    adapter_dir = Path(adapter_dir)
    theirs, ours = resolve_for(model, LoraConfig.from_peft(adapter_dir)), model_sites(model)
    mismatch = [
        f"{site}.{slot}: adapter {_describe(theirs, site, slot)}, model {_describe(ours, site, slot)}"
        for site in sorted(set(theirs) | set(ours))
        for slot in sorted(set(theirs.get(site, {})) | set(ours.get(site, {})))
        if theirs.get(site, {}).get(slot) != ours.get(site, {}).get(slot)
    ]
    if mismatch:
        raise ValueError(
            f"{adapter_dir}: the adapter does not match the model's LoRA config ({'; '.join(mismatch)}); "
            f"build the model with lora=LoraConfig.from_peft({str(adapter_dir)!r})"
        )
    path = adapter_dir / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (only safetensors adapters are supported)")
    config = model_chunks(model)[0].config
    fused = fused_experts(config)  # peft's v4 MLP names mean the routed experts
    with safe_open(str(path), framework="pt") as f:
        available = {k.replace(".default.", "."): k for k in f.keys()}
        # routed experts in transformers 4's per-expert layout: peft's fused tensors, as peft reads them
        converted: dict[str, torch.Tensor] = {}
        if fused:

            def read(key: str) -> torch.Tensor:
                return f.get_tensor(available[key])

            converted, consumed = fuse_per_expert(available, read, config.num_moe_experts, path)
            available = {k: v for k, v in available.items() if k not in consumed} | dict.fromkeys(converted)
        used: set[str] = set()
        for fac in factors(model):
            if fac.key not in available:
                raise ValueError(
                    f"{path}: tensor {fac.key!r} is missing; was the adapter made for this base model?"
                )
            full = converted[fac.key] if fac.key in converted else f.get_tensor(available[fac.key])
            value = _slice_for_rank(full, fac, path)
            if tuple(value.shape) != tuple(fac.tensor.shape):
                raise ValueError(
                    f"{path}: {fac.key!r} gives shape {list(value.shape)} for this rank's factor of shape "
                    f"{list(fac.tensor.shape)}; the adapter was made for a different base model or rank"
                )
            with torch.no_grad():
                fac.tensor.copy_(value.to(fac.tensor.dtype))
            used.add(fac.key)
    if dist.is_initialized():
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, used)
        used = set().union(*everyone)
    unused = sorted(set(available) - used)
    if unused:
        why = "more layers or other targets than the base model has: a different base?"
        if fused and any(".mlp.shared_expert." in k for k in unused):
            why = (
                "on this model gate_proj/up_proj/down_proj name the routed experts, as in peft 0.21 on "
                "transformers 5, so an adapter from transformers 4 that also adapted the shared expert has "
                "factors that peft 0.21 drops without a warning; twinkle does not drop them: remove the "
                "shared_expert tensors from the file to load the rest as peft does"
            )
        raise ValueError(f"{path}: tensors {unused[:6]} match no LoRA factor of this model ({why})")


def _describe(sites: Sites, site: str, slot: str) -> str:
    spec = sites.get(site, {}).get(slot)
    if spec is None:
        return "not adapted"
    return f"r={spec.r} alpha={spec.lora_alpha}{' rslora' if spec.use_rslora else ''}"


def _slice_for_rank(full: torch.Tensor, fac: Factor, path: Path) -> torch.Tensor:
    if fac.rows is not None:
        if full.shape[0] != fac.rows[1].numel():
            raise ValueError(
                f"{path}: {fac.key!r} has {full.shape[0]} rows, the base model {fac.rows[1].numel()}"
            )
        return full[fac.rows[0]]
    if fac.expert is not None:
        which = fac.key.split(".")[-2][-1]
        e = fac.num_experts
        if which == "A":
            if full.shape[0] % e:
                raise ValueError(
                    f"{path}: {fac.key!r} rows {full.shape[0]} are not a multiple of {e} experts"
                )
            full = full.reshape(e, -1, full.shape[-1])[fac.expert]
        else:
            if full.shape[1] % e:
                raise ValueError(
                    f"{path}: {fac.key!r} columns {full.shape[1]} are not a multiple of {e} experts"
                )
            full = full.reshape(full.shape[0], -1, e)[:, :, fac.expert]
    if fac.tp_dim is not None:
        size, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        if full.shape[fac.tp_dim] % size:
            raise ValueError(f"{path}: {fac.key!r} dim {fac.tp_dim} is not divisible by TP size {size}")
        full = full.chunk(size, dim=fac.tp_dim)[rank]
    return full
