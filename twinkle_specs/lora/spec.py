"""Composes LoRA wrappers into a layer's specs: each targeted linear's class is swapped for its LoRA
subclass, with its site, slots (rank, scaling) and dropout passed as ModuleSpec params; the frozen q/k
norms and the attention around them get their LoRA-time classes (:func:`lora_layer_submodules`). Works on
megatron-core 0.16's ModuleSpecs and 0.19's builder partials alike."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from .config import LoraConfig, Sites
from .layers import LoraColumnParallelLinear, LoraRowParallelLinear, LoraTopKRouter

PORTABLE_WRAPPERS: dict[type, type] = {
    ColumnParallelLinear: LoraColumnParallelLinear,
    RowParallelLinear: LoraRowParallelLinear,
    TopKRouter: LoraTopKRouter,
}


TE_MODULE = "megatron.core.extensions.transformer_engine"


def _wrapper_for(base: type) -> type:
    if base in PORTABLE_WRAPPERS:
        return PORTABLE_WRAPPERS[base]
    if base.__module__ == TE_MODULE:
        from .te_layers import WRAPPERS

        if base in WRAPPERS:
            return WRAPPERS[base]
    raise TypeError(f"no LoRA wrapper for {base.__module__}.{base.__qualname__}")


def _wrap(spec: Any, site: str, sites: Sites, dropout: float) -> Any:
    """A linear's spec (class, ModuleSpec or builder partial) as a ModuleSpec of its LoRA wrapper."""
    if site not in sites:
        return spec
    params = spec.params if isinstance(spec, ModuleSpec) else getattr(spec, "keywords", {})
    lora_params = {"lora_site": site, "lora_slots": sites[site], "lora_dropout": dropout}
    return ModuleSpec(module=_wrapper_for(_class_of(spec)), params={**params, **lora_params})


def _submodules(spec: Any) -> Any:
    """The submodules of a ModuleSpec (megatron-core 0.16) or of a builder partial (0.19)."""
    if isinstance(spec, ModuleSpec):
        return spec.submodules
    if isinstance(spec, functools.partial):
        return spec.keywords.get("submodules")
    return None


def _with_submodules(spec: Any, submodules: Any) -> Any:
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, submodules=submodules)
    return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": submodules})


def _wrap_mlp(spec: Any, prefix: str, sites: Sites, dropout: float) -> Any:
    """An MLP-like spec (dense MLP, shared expert, experts) with its targeted linear_fc1/fc2 wrapped and
    the grouped-GEMM experts' others frozen (:func:`_frozen`)."""
    sub = _submodules(spec)
    if not hasattr(sub, "linear_fc1"):
        if _mlp_targeted(prefix, sites):
            raise NotImplementedError(
                f"LoRA cannot adapt {spec!r} (no per-linear submodules); use SequentialMLP or Transformer "
                "Engine grouped-GEMM experts"
            )
        return spec
    adapted = dataclasses.replace(
        sub,
        linear_fc1=_frozen(_wrap(sub.linear_fc1, f"{prefix}linear_fc1", sites, dropout)),
        linear_fc2=_frozen(_wrap(sub.linear_fc2, f"{prefix}linear_fc2", sites, dropout)),
    )
    return spec if adapted == sub else _with_submodules(spec, adapted)


def _mlp_targeted(prefix: str, sites: Sites) -> bool:
    """Whether LoRA adapts the linear_fc1 or linear_fc2 of the MLP-like module at ``prefix``."""
    return f"{prefix}linear_fc1" in sites or f"{prefix}linear_fc2" in sites


def _frozen(spec: Any) -> Any:
    """A TE grouped-GEMM experts' linear that LoRA leaves unadapted as its frozen class, whose base runs as
    one grouped GEMM (:class:`~twinkle_specs.lora.te_layers.FrozenGroupedBase`); any other spec unchanged."""
    base = _class_of(spec)
    if getattr(base, "__module__", None) != TE_MODULE:
        return spec
    from .te_layers import FROZEN

    return _with_class(spec, FROZEN[base]) if base in FROZEN else spec


def _unfused(spec: Any) -> tuple[Any, Any] | None:
    """``(HiddenNorm, the plain TE column-parallel linear's spec)`` for the spec of TE's norm-fused linear,
    None for any other.

    Why an adapted QKV or fc1 is not norm-fused: its adapter reads the normalised input too. Inside TE's
    fused module that input is out of reach (without keeping it: ``return_layernorm_output`` makes TE
    save it, an extra activation per linear), so the adapter had to run its own norm forward and
    backward and add its input gradient to the base's after the norm. With the norm a module of its
    own (what megatron's portable spec and its MoE layers do anyway) the adapter reads the norm's
    output and its gradient joins the base linear's before the one norm backward: on the Qwen3-8B shape
    that is 16 norm kernels forward and 16 backward fewer per step. The norm is
    :class:`~twinkle_specs.lora.norm.HiddenNorm` (TE's arithmetic without the frozen weight's gradient,
    and under FP8 the amax of its output for the linear's cast); checkpoint keys stay those of the fused
    module (``sharded_state_dict_keys_map``)."""
    base = _class_of(spec)
    if base.__module__ != TE_MODULE or base.__name__ != "TELayerNormColumnParallelLinear":
        return None
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

    from .norm import HiddenNorm

    return HiddenNorm, _with_class(spec, TEColumnParallelLinear)


def _qk_norm(spec: Any) -> Any:
    """TE's q/k norm (TENorm) as :class:`~twinkle_specs.lora.norm.QKNorm`, whose backward skips
    the frozen weight's gradient (see :mod:`.norm`); any other spec unchanged."""
    base = _class_of(spec)  # None where the attention has no q/k norm
    if getattr(base, "__module__", None) != TE_MODULE or base.__name__ != "TENorm":
        return spec
    from .norm import QKNorm

    return _with_class(spec, QKNorm)


def _frozen_norms(attn_sub: Any) -> bool:
    """Whether both q/k norms of an attention's submodules are :class:`~twinkle_specs.lora.norm.QKNorm`."""
    from .norm import QKNorm

    return _class_of(attn_sub.q_layernorm) is QKNorm and _class_of(attn_sub.k_layernorm) is QKNorm


def _class_of(spec: Any) -> type:
    """The module class a spec (class, ModuleSpec or builder partial) builds. A partial of a class's
    builder classmethod (megatron-core 0.19's dense MLP: ``partial(MLP.as_mlp_submodule, ...)``)
    builds that class."""
    if isinstance(spec, ModuleSpec):
        return spec.module
    fn = getattr(spec, "func", spec)
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, type) else fn


def _with_class(spec: Any, cls: type) -> Any:
    """``spec`` building ``cls`` instead, with the same parameters and submodules."""
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, module=cls)
    if isinstance(spec, functools.partial):
        fn = spec.func
        if isinstance(getattr(fn, "__self__", None), type):  # the same builder classmethod, on ``cls``
            return functools.partial(getattr(cls, fn.__name__), *spec.args, **spec.keywords)
        return functools.partial(cls, *spec.args, **spec.keywords)
    return cls


def lora_layer_submodules(
    submodules: TransformerLayerSubmodules, lora: LoraConfig, config: TransformerConfig
) -> TransformerLayerSubmodules:
    """``submodules`` with every linear that ``lora`` targets replaced by its LoRA wrapper (a targeted
    norm-fused TE linear first split into its norm and a plain linear, see :func:`_unfused`), TE's
    q/k norms, frozen under LoRA, as :class:`~twinkle_specs.lora.norm.QKNorm` (:func:`_qk_norm`), and
    then megatron's SelfAttention as :class:`~twinkle_specs.lora.attention.LoraSelfAttention`, which
    fuses those norms and RoPE with the QKV split where it can.

    Qwen3-MoE (MoE with q/k norm, among the supported Qwen models) is the fused-expert model on which
    peft maps gate/up/down_proj to the routed experts; Qwen2-MoE's MLP names mean its shared expert.

    Hybrid models: a Gated DeltaNet layer's ``in_proj``/``out_proj`` are wrapped (:func:`_wrap_gdn`); the
    gated attention of their full-attention layers keeps its own q/k norms (zero-centred) and class,
    since the fused norm/RoPE split of LoraSelfAttention knows no output gate.
    """
    sites = lora.resolve(
        fused_experts=fused_experts(config),
        shared_expert=bool(config.moe_shared_expert_intermediate_size),
        num_layers=config.num_layers,
        in_proj=lora_in_proj(config),
    )
    p = lora.lora_dropout
    layer = {}  # the layer's submodules that change besides attention and MLP
    keys_map = dict(submodules.sharded_state_dict_keys_map)
    attn = submodules.self_attention
    attn_sub = _submodules(attn)
    if isinstance(attn_sub, GatedDeltaNetSubmodules):
        attn, layer, keys_map = _wrap_gdn(attn, sites, p, lora_in_proj(config), submodules, keys_map)
        return _with_mlp(submodules, attn, layer, keys_map, sites, p)
    qkv = attn_sub.linear_qkv
    if "linear_qkv" in sites and (split := _unfused(qkv)):
        layer["input_layernorm"], qkv = split
        keys_map["input_layernorm."] = "self_attention.linear_qkv.layer_norm_"
    gated = bool(config.attention_output_gate)
    attn_sub = dataclasses.replace(
        attn_sub,
        linear_qkv=_wrap(qkv, "linear_qkv", sites, p),
        linear_proj=_wrap(attn_sub.linear_proj, "linear_proj", sites, p),
        q_layernorm=attn_sub.q_layernorm if gated else _qk_norm(attn_sub.q_layernorm),
        k_layernorm=attn_sub.k_layernorm if gated else _qk_norm(attn_sub.k_layernorm),
    )
    attn = _with_submodules(attn, attn_sub)
    if _class_of(attn) is SelfAttention and _frozen_norms(attn_sub):
        from .attention import LoraSelfAttention  # the frozen q/k norms and RoPE fused with the split

        attn = _with_class(attn, LoraSelfAttention)
    return _with_mlp(submodules, attn, layer, keys_map, sites, p)


def fused_experts(config: TransformerConfig) -> bool:
    """Whether peft maps v4 MLP names to the routed experts on this model: Qwen3-MoE (MoE with q/k norm)
    and what :func:`~twinkle_specs.lora.config.set_model_facts` recorded for hybrid models."""
    recorded = getattr(config, "lora_fused_experts", None)
    if recorded is not None:
        return bool(config.num_moe_experts) and recorded
    return bool(config.num_moe_experts) and config.qk_layernorm


def lora_in_proj(config: TransformerConfig) -> str | None:
    """The Gated DeltaNet input site of the model ``config`` describes (set beside ``config.lora`` from the
    Hugging Face architecture, :func:`~twinkle_specs.lora.config.in_proj_site`); None without such layers."""
    if config.experimental_attention_variant != "gated_delta_net":
        return None
    site = getattr(config, "lora_in_proj", None)
    if site is None:
        raise ValueError(
            "LoRA on a Gated DeltaNet model needs config.lora_in_proj (in_proj or in_proj_fused, from "
            "twinkle_specs.lora.config.in_proj_site(arch)); build the model with build_model(hf_dir, lora=...)"
        )
    return site


def _wrap_gdn(attn: Any, sites: Sites, p: float, in_proj_site: str | None, submodules, keys_map: dict):
    """A Gated DeltaNet spec with its in_proj (site ``in_proj_site``) and out_proj wrapped; a targeted
    TE in_proj with the layer's input norm fused is split into that norm and a plain linear first."""
    sub, layer = _submodules(attn), {}
    in_proj = sub.in_proj
    if in_proj_site in sites and (split := _unfused(in_proj)):
        layer["input_layernorm"], in_proj = split
        keys_map = {**keys_map, "input_layernorm.": "self_attention.in_proj.layer_norm_"}
    sub = dataclasses.replace(
        sub,
        in_proj=_wrap(in_proj, in_proj_site, sites, p),
        out_proj=_wrap(sub.out_proj, "out_proj", sites, p),
    )
    return _with_submodules(attn, sub), layer, keys_map


def _with_mlp(
    submodules: TransformerLayerSubmodules, attn: Any, layer: dict, keys_map: dict, sites: Sites, p: float
) -> TransformerLayerSubmodules:
    """``submodules`` with attention ``attn``, the MLP's targeted linears wrapped, and ``layer``'s norms."""
    mlp = submodules.mlp
    mlp_sub = _submodules(mlp)
    if isinstance(mlp_sub, MoESubmodules):
        experts = _wrap_mlp(mlp_sub.experts, "experts.", sites, p)
        if _class_of(experts) is TEGroupedMLP:
            # adapted: fc2's adapter input recomputed, not kept; either way the token counts on the device
            from .mlp import FrozenGroupedMLP, LoraGroupedMLP

            adapted = _mlp_targeted("experts.", sites)
            experts = _with_class(experts, LoraGroupedMLP if adapted else FrozenGroupedMLP)
        mlp_sub = dataclasses.replace(
            mlp_sub,
            experts=experts,
            shared_experts=mlp_sub.shared_experts and _wrap_mlp(mlp_sub.shared_experts, "", sites, p),
            router=_wrap(mlp_sub.router, "router", sites, p),
        )
        mlp = _with_submodules(mlp, mlp_sub)
    else:
        if "linear_fc1" in sites and (split := _unfused(mlp_sub.linear_fc1)):
            layer["pre_mlp_layernorm"], fc1 = split
            keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
            mlp = _with_submodules(mlp, dataclasses.replace(mlp_sub, linear_fc1=fc1))
        mlp = _wrap_mlp(mlp, "", sites, p)
        if "linear_fc1" in sites and _class_of(mlp) is MLP:
            from .mlp import LoraMLP  # fc1's delta applied inside SwiGLU

            mlp = _with_class(mlp, LoraMLP)
    return dataclasses.replace(
        submodules,
        self_attention=attn,
        mlp=mlp,
        sharded_state_dict_keys_map=keys_map,
        **layer,
    )
