"""Routed-expert adapters in the per-expert layout of transformers 4, read as peft reads them on transformers 5.

Before transformers 5 a Qwen3-MoE or Qwen3-Next expert was three ``nn.Linear`` modules, so adapters trained
then (transformers 4 + peft, and the trainers built on them) hold ``...mlp.experts.<e>.gate_proj.lora_A.weight``
and so on per expert. Transformers 5 fuses each layer's experts into ``gate_up_proj`` and ``down_proj``
tensors; peft 0.21 converts such an adapter when it loads it (``peft.utils.transformers_weight_conversion``):
gate and up become one adapter of rank 2r whose A stacks the two A's and whose B is their block diagonal
(``LoraConfig.resolve`` gives the same rank 2r and alpha 2*alpha), down keeps its own. :func:`fuse_per_expert`
does that conversion, into peft's ``target_parameters`` layout (:func:`stack_experts`). :func:`split_experts`
writes an expert factor the other way, for exports in that layout (``export_peft_adapter(...,
expert_layout="per-expert")``): gate and up of one rank-r adapter share its A and split its B by rows, so
each is exactly a rank-r adapter of its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

PER_EXPERT = re.compile(
    r"^(?P<module>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.lora_(?P<which>[AB])\.weight$"
)


def _in_order(per_expert: dict[int, torch.Tensor], key: str, num: int) -> list[torch.Tensor]:
    """Experts 0 to ``num`` - 1 of one factor, each gathered from the rank that holds it."""
    missing = sorted(set(range(num)) - set(per_expert))
    if missing:
        raise RuntimeError(f"{key}: experts {missing} were not found on any rank")
    return [per_expert[e] for e in range(num)]


def stack_experts(per_expert: dict[int, torch.Tensor], which: str, key: str, num: int) -> torch.Tensor:
    """One routed-expert factor in peft's ``target_parameters`` layout: A [r * E, in] expert-major, B
    [out, r * E] rank-major (expert-minor), from each expert's [r, in] / [out, r]."""
    stacked = torch.stack(_in_order(per_expert, key, num))  # [E, r, in] or [E, out, r]
    if which == "A":
        return stacked.reshape(-1, stacked.shape[-1])
    return stacked.permute(1, 2, 0).reshape(stacked.shape[1], -1)


def split_experts(
    per_expert: dict[int, torch.Tensor], which: str, key: str, slot: str, num: int
) -> dict[str, torch.Tensor]:
    """One routed-expert factor (``key`` its name in peft's ``target_parameters`` layout, ``slot`` gate_up_proj
    or down_proj, each expert's [r, in] A or [out, r] B) under transformers 4's per-expert names: gate_up's A
    for both gate_proj and up_proj, its B's first half of the rows (transformers' gate) for gate_proj, the
    second for up_proj."""
    module = key.split(".lora_")[0].removesuffix(".base_layer")
    out: dict[str, torch.Tensor] = {}
    for e, t in enumerate(_in_order(per_expert, key, num)):
        if slot == "down_proj":
            parts = {"down_proj": t}
        elif which == "A":  # a copy for up: safetensors refuses tensors that share storage
            parts = {"gate_proj": t, "up_proj": t.clone()}
        else:
            gate, up = t.chunk(2)
            parts = {"gate_proj": gate.clone(), "up_proj": up.clone()}
        for proj, tensor in parts.items():
            out[f"{module}.{e}.{proj}.lora_{which}.weight"] = tensor
    return out


def fuse_per_expert(
    keys: Iterable[str], read: Callable[[str], torch.Tensor], num_experts: int, where: Path
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The fused tensors, under peft's names, of every per-expert key among ``keys`` (``read`` gives a key's
    tensor) for a model of ``num_experts`` routed experts, and the keys they were made from; nothing where
    the adapter has no per-expert keys."""
    found: dict[str, dict[tuple[str, int, str], str]] = {}  # module -> (projection, expert, A/B) -> key
    for key in keys:
        m = PER_EXPERT.match(key)
        if m:
            found.setdefault(m["module"], {})[m["proj"], int(m["expert"]), m["which"]] = key
    experts = range(num_experts)
    fused: dict[str, torch.Tensor] = {}
    for module, named in sorted(found.items()):
        projs = {proj for proj, _, _ in named}
        if ("gate_proj" in projs) != ("up_proj" in projs):
            have, lack = ("gate_proj", "up_proj") if "gate_proj" in projs else ("up_proj", "gate_proj")
            raise ValueError(
                f"{where}: {module} has {have} adapters but no {lack}; transformers 5 fuses the two into "
                "gate_up_proj, so they are adapted together (as peft requires)"
            )
        present = {e for _, e, _ in named}
        extra = sorted(present - set(experts))
        if extra:
            raise ValueError(
                f"{where}: {module} has adapters for experts {extra[:8]}, the base model {num_experts} experts "
                f"(0 to {num_experts - 1}): was the adapter made for this base model?"
            )
        missing = [f"expert {e}" for e in experts if e not in present]
        missing += [
            f"{proj} expert {e} lora_{w}"
            for proj in sorted(projs)
            for e in sorted(present)
            for w in "AB"
            if (proj, e, w) not in named
        ]
        if missing:
            raise ValueError(
                f"{where}: {module}'s per-expert adapters are incomplete ({', '.join(missing)[:300]}): every "
                "expert needs lora_A and lora_B of each adapted projection"
            )

        def factor(proj: str, which: str, named=named) -> dict[int, torch.Tensor]:
            return {e: read(named[proj, e, which]) for e in experts}

        prefix = f"{module}.base_layer" if projs == {"gate_proj", "up_proj", "down_proj"} else module
        try:
            if "gate_proj" in projs:
                gate_a, up_a = factor("gate_proj", "A"), factor("up_proj", "A")
                gate_b, up_b = factor("gate_proj", "B"), factor("up_proj", "B")
                a = {e: torch.cat([gate_a[e], up_a[e]]) for e in experts}
                b = {e: torch.block_diag(gate_b[e], up_b[e]) for e in experts}
                fused[f"{prefix}.lora_A.weight"] = stack_experts(a, "A", module, num_experts)
                fused[f"{prefix}.lora_B.weight"] = stack_experts(b, "B", module, num_experts)
            if "down_proj" in projs:
                for w in "AB":
                    fused[f"{module}.lora_{w}.weight"] = stack_experts(
                        factor("down_proj", w), w, module, num_experts
                    )
        except RuntimeError as err:  # torch's cat/stack on experts of unequal shapes
            raise ValueError(
                f"{where}: {module}'s per-expert adapters do not fit together (gate and up of one rank, "
                f"every expert of one shape): {err}"
            ) from err
    return fused, {key for named in found.values() for key in named.values()}
