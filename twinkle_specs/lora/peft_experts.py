"""Routed-expert adapters in the per-expert layout of transformers 4, read as peft reads them on transformers 5.

Before transformers 5 a Qwen3-MoE or Qwen3-Next expert was three ``nn.Linear`` modules, so adapters trained
then (transformers 4 + peft, and the trainers built on them) hold ``...mlp.experts.<e>.gate_proj.lora_A.weight``
and so on per expert. Transformers 5 fuses each layer's experts into ``gate_up_proj`` and ``down_proj``
tensors; peft 0.21 converts such an adapter when it loads it (``peft.utils.transformers_weight_conversion``):
gate and up become one adapter of rank 2r whose A stacks the two A's and whose B is their block diagonal
(``LoraConfig.resolve`` gives the same rank 2r and alpha 2*alpha), down keeps its own. :func:`fuse_per_expert`
does that conversion, into peft's ``target_parameters`` layout (:func:`stack_experts`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

PER_EXPERT = re.compile(
    r"^(?P<module>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.lora_(?P<which>[AB])\.weight$"
)


def stack_experts(per_expert: dict[int, torch.Tensor], which: str, key: str, num: int) -> torch.Tensor:
    """One routed-expert factor in peft's ``target_parameters`` layout: A [r * E, in] expert-major, B
    [out, r * E] rank-major (expert-minor), from each expert's [r, in] / [out, r]."""
    missing = sorted(set(range(num)) - set(per_expert))
    if missing:
        raise RuntimeError(f"{key}: experts {missing} were not found on any rank")
    stacked = torch.stack([per_expert[e] for e in range(num)])  # [E, r, in] or [E, out, r]
    if which == "A":
        return stacked.reshape(-1, stacked.shape[-1])
    return stacked.permute(1, 2, 0).reshape(stacked.shape[1], -1)


def fuse_per_expert(
    keys: Iterable[str], read: Callable[[str], torch.Tensor], num_experts: int, where: Path
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The fused tensors, under peft's names, of every per-expert key among ``keys`` (``read`` gives a key's
    tensor) for a model of ``num_experts`` routed experts, and the keys they were made from; nothing where
    the adapter has no per-expert keys."""
    found: dict[str, dict[str, dict[int, dict[str, str]]]] = {}  # module -> proj -> expert -> which -> key
    for key in keys:
        m = PER_EXPERT.match(key)
        if m:
            found.setdefault(m["module"], {}).setdefault(m["proj"], {}).setdefault(int(m["expert"]), {})[
                m["which"]
            ] = key
    fused: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for module, projs in sorted(found.items()):
        if ("gate_proj" in projs) != ("up_proj" in projs):
            have, lack = ("gate_proj", "up_proj") if "gate_proj" in projs else ("up_proj", "gate_proj")
            raise ValueError(
                f"{where}: {module} has {have} adapters but no {lack}; transformers 5 fuses the two into "
                "gate_up_proj, so they are adapted together (as peft requires)"
            )
        experts = range(num_experts)
        extra = sorted({e for per in projs.values() for e in per} - set(experts))
        if extra:
            raise ValueError(
                f"{where}: {module} has adapters for experts {extra[:8]}, the base model {num_experts} experts "
                f"(0 to {num_experts - 1}): was the adapter made for this base model?"
            )
        missing = [e for e in experts if not any(e in per for per in projs.values())]
        incomplete = [
            f"{proj} expert {e} lora_{w}"
            for proj, per in projs.items()
            for e in experts
            if e not in missing
            for w in "AB"
            if w not in per.get(e, {})
        ]
        if missing or incomplete:
            raise ValueError(
                f"{where}: {module}'s per-expert adapters are incomplete "
                f"({', '.join([f'expert {e}' for e in missing] + incomplete)[:300]}): every expert needs "
                "lora_A and lora_B of each adapted projection"
            )
        num = num_experts
        prefix = f"{module}.base_layer" if "down_proj" in projs and "gate_proj" in projs else module
        try:
            if "gate_proj" in projs:
                gate, up = projs["gate_proj"], projs["up_proj"]
                a = {e: torch.cat([read(gate[e]["A"]), read(up[e]["A"])]) for e in experts}
                b = {e: torch.block_diag(read(gate[e]["B"]), read(up[e]["B"])) for e in experts}
                fused[f"{prefix}.lora_A.weight"] = stack_experts(a, "A", module, num)
                fused[f"{prefix}.lora_B.weight"] = stack_experts(b, "B", module, num)
            if "down_proj" in projs:
                down = projs["down_proj"]
                for w in "AB":
                    fused[f"{module}.lora_{w}.weight"] = stack_experts(
                        {e: read(down[e][w]) for e in experts}, w, module, num
                    )
        except RuntimeError as err:  # torch's cat/stack on experts of unequal shapes
            raise ValueError(
                f"{where}: {module}'s per-expert adapters do not fit together (gate and up of one rank, "
                f"every expert of one shape): {err}"
            ) from err
        used |= {k for per in projs.values() for factors in per.values() for k in factors.values()}
    return fused, used
