"""LoRA options, named as in ``peft.LoraConfig``, and their resolution onto Megatron's fused linears.

Targets follow what peft 0.21 does on the transformers 5 model: ``q_proj`` adapts only the query rows
of Megatron's fused ``linear_qkv``, ``gate_proj`` only the gate half of ``linear_fc1`` (dense MLP or
Qwen2-MoE's shared expert, as PEFT's suffix match does). Routed experts are fused 3-D parameters in
transformers 5 and are adapted through ``target_parameters`` (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``, the router ``mlp.gate.weight``). On Qwen3-MoE, peft rewrites the v4 names
``gate_proj``/``up_proj``/``down_proj`` (and ``all-linear``) to those expert parameters, with
``gate_up_proj`` at rank 2r and alpha 2*alpha; :meth:`LoraConfig.resolve` does the same, so one
LoraConfig means the same adapter in Megatron and in PEFT. Megatron names adapt whole fused linears.

Hybrid models (Qwen3-Next, Qwen3.5): the Gated DeltaNet's fused ``in_proj`` is one site whose slots are
transformers' projections (Qwen3.5's ``in_proj_qkv``/``in_proj_z``/``in_proj_b``/``in_proj_a`` or
Qwen3-Next's ``in_proj_qkvz``/``in_proj_ba``: sites ``in_proj`` and ``in_proj_fused``), ``out_proj`` a
single-slot row-parallel site; the gated attention's ``q_proj`` slot holds queries and gates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

# Routed experts in a PEFT export: peft's target_parameters (transformers 5) or transformers 4's per-expert names
EXPERT_LAYOUTS = ("fused", "per-expert")
# Site of a Megatron linear -> its adapter slots, in output order. A slot is one PEFT adapter (own A, B).
SITE_SLOTS: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),  # dense MLP or shared expert
    "linear_fc2": ("down_proj",),
    "experts.linear_fc1": ("gate_up_proj",),  # routed experts: one adapter over [gate; up] per expert
    "experts.linear_fc2": ("down_proj",),
    "router": ("gate",),
    "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),  # Gated DeltaNet, Qwen3.5
    "in_proj_fused": ("in_proj_qkvz", "in_proj_ba"),  # Gated DeltaNet, Qwen3-Next
    "out_proj": ("out_proj",),
}
# The Gated DeltaNet sites: a model has in_proj or in_proj_fused (see in_proj_site), and out_proj.
LINEAR_ATTENTION_SITES = ("in_proj", "in_proj_fused", "out_proj")
LINEAR_ATTENTION_MODULES = {slot: site for site in LINEAR_ATTENTION_SITES for slot in SITE_SLOTS[site]}
HF_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MEGATRON_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "router")
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight")
_ATTENTION = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj"}
_MLP = {"gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}


@dataclass(frozen=True)
class SlotSpec:
    """Rank and scaling of one adapter slot."""

    r: int
    lora_alpha: float
    use_rslora: bool

    @property
    def scaling(self) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


Sites = dict[str, dict[str, SlotSpec]]


def slot_path(site: str, slot: str, shared_expert: bool) -> str:
    """The slot's module (or parameter) path inside an HF decoder layer, e.g. ``self_attn.q_proj``."""
    if site in ("linear_qkv", "linear_proj"):
        return f"self_attn.{slot}"
    if site in LINEAR_ATTENTION_SITES:
        return f"linear_attn.{slot}"
    if site.startswith("experts."):
        return f"mlp.experts.{slot}"
    if site == "router":
        return "mlp.gate"
    return f"mlp.shared_expert.{slot}" if shared_expert else f"mlp.{slot}"


@dataclass(frozen=True)
class LoraConfig:
    """LoRA hyper-parameters (field names and defaults as in ``peft.LoraConfig``).

    ``target_modules``: HF projection names (q_proj ... down_proj), Megatron linear names (linear_qkv,
    linear_proj, linear_fc1, linear_fc2 (these include routed experts), router) or ``"all-linear"``.
    ``target_parameters``: routed experts and router, as in peft. ``rank_pattern``/``alpha_pattern``:
    PEFT's per-module overrides, matched as peft matches them (``get_pattern_key``: the first key that
    matches the end of the module's full name, e.g. ``model.layers.3.self_attn.q_proj``, at a dot). A
    pattern may name layers, but must give a module the same rank and alpha in every layer: Megatron
    builds every layer from one spec, so per-layer adapters are refused, naming the pattern.
    A is initialised like PEFT's (Kaiming-uniform), B with zeros, so a fresh adapter changes nothing.
    """

    r: int = 8
    lora_alpha: float = 8
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] | str = ("q_proj", "v_proj")
    target_parameters: tuple[str, ...] = ()
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"LoraConfig.r must be a positive integer, got {self.r!r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"LoraConfig.lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        targets = (self.target_modules,) if isinstance(self.target_modules, str) else self.target_modules
        object.__setattr__(self, "target_modules", tuple(targets))
        object.__setattr__(self, "target_parameters", tuple(self.target_parameters))
        object.__setattr__(self, "rank_pattern", dict(self.rank_pattern))
        object.__setattr__(self, "alpha_pattern", dict(self.alpha_pattern))
        for name in self.target_modules:
            known = HF_MODULES + MEGATRON_MODULES + tuple(LINEAR_ATTENTION_MODULES)
            if name != "all-linear" and name not in known:
                raise ValueError(
                    f"LoraConfig: unknown target module {name!r}. Use Hugging Face projection names "
                    f"{list(HF_MODULES + tuple(LINEAR_ATTENTION_MODULES))}, Megatron names {list(MEGATRON_MODULES)} or 'all-linear' (routed "
                    "experts also via target_parameters; Qwen2-MoE's shared_expert_gate is not supported)"
                )
        for name in self.target_parameters:
            if _parameter_site(name) is None:
                raise ValueError(
                    f"LoraConfig: unknown target parameter {name!r}; supported: {list(EXPERT_PARAMETERS)}"
                )
        # fail early on empty targets
        self.resolve(fused_experts=False, shared_expert=False, in_proj=ANY_IN_PROJ)

    def resolve(
        self, *, fused_experts: bool, shared_expert: bool, num_layers: int = 1, in_proj: str | None = None
    ) -> Sites:
        """Site -> slot -> rank/scaling for one model kind.

        ``fused_experts``: a transformers-5 fused-expert model on which peft rewrites v4 MLP names to
        expert parameters (Qwen3-MoE); ``shared_expert``: the MLP names mean the shared expert.
        ``num_layers``: the model's layers, each of which must resolve to the same ranks and alphas.
        ``in_proj``: the model's Gated DeltaNet input site (:func:`in_proj_site`), None without such
        layers; as in peft, names of projections the model lacks select nothing.
        """
        modules, params = set(self.target_modules), set(self.target_parameters)
        rank_pattern, alpha_pattern = dict(self.rank_pattern), dict(self.alpha_pattern)
        linear_sites = {"out_proj"} | ({in_proj} if in_proj != ANY_IN_PROJ else {"in_proj", "in_proj_fused"})
        linear_sites = linear_sites if in_proj is not None else set()
        if "all-linear" in modules:
            modules = (modules - {"all-linear"}) | set(HF_MODULES)
            modules |= {m for m, site in LINEAR_ATTENTION_MODULES.items() if site in linear_sites}
            if fused_experts:
                params.add("mlp.gate.weight")
        chosen: dict[str, set[str]] = {}
        for name in sorted(modules):
            if name in _ATTENTION:
                chosen.setdefault(_ATTENTION[name], set()).add(name)
            elif name in LINEAR_ATTENTION_MODULES:
                if LINEAR_ATTENTION_MODULES[name] in linear_sites:
                    chosen.setdefault(LINEAR_ATTENTION_MODULES[name], set()).add(name)
            elif name in _MLP and not fused_experts:
                chosen.setdefault(_MLP[name], set()).add(name)
            elif name in MEGATRON_MODULES:
                for site in (name, f"experts.{name}"):
                    if site in SITE_SLOTS:
                        chosen.setdefault(site, set()).update(SITE_SLOTS[site])
        if fused_experts:
            fused = {"gate_proj", "up_proj"} & modules
            if len(fused) == 1:
                raise ValueError(
                    f"LoraConfig: on this fused-expert model (Qwen3-MoE) {sorted(fused)[0]} cannot be adapted "
                    "without also targeting the other of gate_proj/up_proj (as in peft: they are fused into "
                    "mlp.experts.gate_up_proj)"
                )
            if fused:
                params.add("mlp.experts.gate_up_proj")
                # peft's v4->v5 conversion: two rank-r adapters fused into one of rank 2r, alpha doubled
                rank_pattern.setdefault(r".*\.gate_up_proj", 2 * self.r)
                alpha_pattern.setdefault(r".*\.gate_up_proj", 2 * self.lora_alpha)
            if "down_proj" in modules:
                params.add("mlp.experts.down_proj")
        for name in params:
            site = _parameter_site(name)
            chosen.setdefault(site, set()).update(SITE_SLOTS[site])
        if not chosen:
            raise ValueError("LoraConfig: target_modules and target_parameters select nothing to adapt")
        sites: Sites = {}
        for site, slots in chosen.items():
            sites[site] = {}
            for slot in (s for s in SITE_SLOTS[site] if s in slots):
                path = pattern_path(site, slot, shared_expert)
                per_layer = {
                    i: (
                        int(_pattern_value(rank_pattern, f"model.layers.{i}.{path}", self.r)),
                        _pattern_value(alpha_pattern, f"model.layers.{i}.{path}", self.lora_alpha),
                    )
                    for i in range(num_layers)
                }
                if len(set(per_layer.values())) > 1:
                    raise ValueError(_per_layer_message(path, per_layer, rank_pattern, alpha_pattern))
                sites[site][slot] = SlotSpec(*per_layer[0], self.use_rslora)
        return sites

    @classmethod
    def from_peft(cls, adapter_dir: str | Path) -> LoraConfig:
        """The LoraConfig of a PEFT adapter directory (adapter_config.json written by peft)."""
        import json

        path = Path(adapter_dir) / "adapter_config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: expected a PEFT adapter directory")
        raw = json.loads(path.read_text())
        if raw.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{path}: peft_type {raw['peft_type']!r} is not LORA")
        unsupported = {
            "bias": "none",  # trained biases: Megatron's LoRA holds factors only
            "use_dora": False,
            "fan_in_fan_out": False,
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
            rank_pattern=raw.get("rank_pattern") or {},
            alpha_pattern=raw.get("alpha_pattern") or {},
        )


ANY_IN_PROJ = "any"  # resolve's in_proj when the model is not known yet (both sets of names are valid)


def set_model_facts(config, arch) -> None:
    """Records on a TransformerConfig what resolving LoRA targets needs from the Hugging Face model that
    the config does not say: the Gated DeltaNet input site (``lora_in_proj``) and, on hybrid MoE models,
    whether peft maps v4 MLP names to the routed experts (``lora_fused_experts``): peft does so through
    transformers' conversion table for Qwen3-Next (as for Qwen3-MoE), not for Qwen3.5-MoE, whose
    gate/up/down_proj mean the shared expert (as on Qwen2-MoE)."""
    config.lora_in_proj = in_proj_site(arch)
    config.lora_fused_experts = arch.hybrid.fused_projections if arch.hybrid is not None else None


def in_proj_site(arch) -> str | None:
    """The Gated DeltaNet input site of a model (a QwenArch): Qwen3-Next's fused projections or
    Qwen3.5's four; None for a model without linear-attention layers."""
    if arch.hybrid is None:
        return None
    return "in_proj_fused" if arch.hybrid.fused_projections else "in_proj"


def pattern_path(site: str, slot: str, shared_expert: bool) -> str:
    """The layer-relative name peft matches rank/alpha patterns against: the module's path, and for a
    ``target_parameters`` entry the parameter's (``mlp.gate.weight``, ``mlp.experts.down_proj``)."""
    path = slot_path(site, slot, shared_expert)
    return f"{path}.weight" if site == "router" else path


def _per_layer_message(path: str, per_layer: dict, rank_pattern: Mapping, alpha_pattern: Mapping) -> str:
    from peft.utils.other import get_pattern_key

    groups: dict[tuple, list[int]] = {}
    for i, value in per_layer.items():
        groups.setdefault(value, []).append(i)
    keys = {
        get_pattern_key(list(patterns), f"model.layers.{i}.{path}")
        for patterns in (rank_pattern, alpha_pattern)
        for i in per_layer
    } & (set(rank_pattern) | set(alpha_pattern))
    found = "; ".join(f"r={r} alpha={a} in layers {layers}" for (r, a), layers in groups.items())
    return (
        f"LoraConfig: rank/alpha pattern(s) {sorted(keys)} give {path} different adapters per layer ({found}); "
        "Megatron builds every layer from one spec, so per-layer ranks and alphas cannot be represented: "
        "use patterns that select the module in every layer (e.g. '.*\\.q_proj')"
    )


def _parameter_site(name: str) -> str | None:
    """peft target_parameters name (any suffix of the full path) -> Megatron site."""
    for full, site in zip(
        EXPERT_PARAMETERS, ("experts.linear_fc1", "experts.linear_fc2", "router"), strict=True
    ):
        if full == name or full.endswith(f".{name}"):
            return site
    return None


def _pattern_value(patterns: Mapping[str, float], path: str, default: float) -> float:
    """The value peft's LoraModel gives the module ``path`` (its full name): peft's own
    ``get_pattern_key`` (the first key matching the end of the name at a dot), else ``default``."""
    if not patterns:
        return default
    from peft.utils.other import get_pattern_key

    return patterns.get(get_pattern_key(list(patterns), path), default)
