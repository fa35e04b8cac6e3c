"""LoRA options, named as in ``peft.LoraConfig``, and their resolution onto Megatron's fused linears.

Targets follow PEFT's semantics on the Hugging Face model exactly: ``q_proj`` adapts only the query
rows of Megatron's fused ``linear_qkv``, ``gate_proj`` only the gate half of ``linear_fc1`` (dense MLP
and shared expert, as PEFT's suffix match does), and routed experts, which transformers stores as fused
3-D parameters, are adapted only through ``target_parameters`` (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``), as in current peft. Megatron names adapt whole fused linears.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

# Site of a Megatron linear -> the adapter slots it can hold, in output order. Each slot is one PEFT
# adapter (its own A and B); a site may hold a subset of its slots.
SITE_SLOTS: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),  # dense MLP and shared expert
    "linear_fc2": ("down_proj",),
    "experts.linear_fc1": ("gate_up_proj",),  # routed experts: one adapter over [gate; up] per expert
    "experts.linear_fc2": ("down_proj",),
}
HF_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MEGATRON_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
EXPERT_PARAMETERS = {"gate_up_proj": "experts.linear_fc1", "down_proj": "experts.linear_fc2"}
_HF_SITE = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}


@dataclass(frozen=True)
class LoraConfig:
    """LoRA hyper-parameters (field names and defaults as in ``peft.LoraConfig``).

    ``target_modules``: HF projection names (q_proj ... down_proj), Megatron linear names (linear_qkv,
    linear_proj, linear_fc1, linear_fc2; these include routed experts) or ``"all-linear"`` (every
    attention and dense/shared-expert projection, like PEFT's; the output layer, router and Qwen2-MoE
    shared_expert_gate are never adapted). ``target_parameters``: routed experts, as in peft
    (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``). A is initialised like PEFT's
    (Kaiming-uniform), B with zeros, so a fresh adapter leaves the model unchanged.
    """

    r: int = 8
    lora_alpha: float = 8
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] | str = ("q_proj", "v_proj")
    target_parameters: tuple[str, ...] = ()
    use_rslora: bool = False
    sites: dict[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"LoraConfig.r must be a positive integer, got {self.r!r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"LoraConfig.lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        targets = (self.target_modules,) if isinstance(self.target_modules, str) else self.target_modules
        object.__setattr__(self, "target_modules", tuple(targets))
        object.__setattr__(self, "target_parameters", tuple(self.target_parameters))
        object.__setattr__(self, "sites", _resolve(self.target_modules, self.target_parameters))

    @property
    def scaling(self) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def slots(self, site: str) -> tuple[str, ...]:
        """The adapter slots of Megatron linear ``site`` (empty: not adapted)."""
        return self.sites.get(site, ())

    @classmethod
    def from_peft(cls, adapter_dir: str | Path) -> LoraConfig:
        """The LoraConfig of a PEFT adapter directory (adapter_config.json written by peft)."""
        path = Path(adapter_dir) / "adapter_config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: expected a PEFT adapter directory")
        raw = json.loads(path.read_text())
        if raw.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{path}: peft_type {raw['peft_type']!r} is not LORA")
        unsupported = {
            "use_dora": False,
            "fan_in_fan_out": False,
            "rank_pattern": {},
            "alpha_pattern": {},
            "lora_bias": False,
            "layers_to_transform": None,
            "modules_to_save": None,
            "exclude_modules": None,
            "layer_replication": None,
            "trainable_token_indices": None,
        }
        for key, default in unsupported.items():
            if raw.get(key, default) not in (default, None, {}, []):
                raise ValueError(f"{path}: {key}={raw[key]!r} is not supported (only plain LoRA)")
        targets = raw.get("target_modules") or ()
        if isinstance(targets, str) and targets != "all-linear":
            raise ValueError(
                f"{path}: target_modules is the regex {targets!r}; only a list of module names or "
                "'all-linear' can be mapped onto Megatron's linears"
            )
        modules = targets if isinstance(targets, str) else tuple(sorted({t.split(".")[-1] for t in targets}))
        return cls(
            r=int(raw["r"]),
            lora_alpha=raw.get("lora_alpha", 8),
            lora_dropout=float(raw.get("lora_dropout", 0.0)),
            target_modules=modules,
            target_parameters=tuple(sorted(raw.get("target_parameters") or ())),
            use_rslora=bool(raw.get("use_rslora", False)),
        )


def _resolve(modules: tuple[str, ...], parameters: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    chosen: dict[str, set[str]] = {}
    for name in modules:
        if name == "all-linear":
            for site in MEGATRON_MODULES:
                chosen.setdefault(site, set()).update(SITE_SLOTS[site])
        elif name in _HF_SITE:
            chosen.setdefault(_HF_SITE[name], set()).add(name)
        elif name in MEGATRON_MODULES:
            for site in (name, f"experts.{name}"):
                if site in SITE_SLOTS:
                    chosen.setdefault(site, set()).update(SITE_SLOTS[site])
        else:
            raise ValueError(
                f"LoraConfig: unknown target module {name!r}. Use Hugging Face projection names "
                f"{list(HF_MODULES)}, Megatron linear names {list(MEGATRON_MODULES)} or 'all-linear' "
                "(routed experts go in target_parameters; the router and shared_expert_gate are not "
                "supported)"
            )
    for name in parameters:
        leaf = name.split(".")[-1]
        if not name.endswith(f"experts.{leaf}") or leaf not in EXPERT_PARAMETERS:
            raise ValueError(
                f"LoraConfig: unknown target parameter {name!r}; supported: "
                f"{[f'mlp.experts.{p}' for p in EXPERT_PARAMETERS]}"
            )
        site = EXPERT_PARAMETERS[leaf]
        chosen.setdefault(site, set()).update(SITE_SLOTS[site])
    if not chosen:
        raise ValueError("LoraConfig: target_modules and target_parameters select nothing to adapt")
    return {site: tuple(s for s in SITE_SLOTS[site] if s in slots) for site, slots in chosen.items()}
