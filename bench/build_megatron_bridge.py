"""Peer: NVIDIA Megatron-Bridge's PEFT LoRA (PyPI ``megatron-bridge``, import ``megatron.bridge``).

The model is built the way Megatron-Bridge's finetune recipes build it: ``AutoBridge.from_hf_pretrained``
on the local HF directory, ``to_megatron_provider`` (its ``GPTModelProvider`` and its TE layer spec),
``apply_overrides_and_finalize``, then ``provide_distributed_model`` with its PEFT transform as the
pre-wrap hook (``peft(model, training=True)`` and ``peft.set_params_to_save``, as
``megatron.bridge.training.setup._apply_peft_transformation`` does). Everything after the model is this
harness's, for fairness with (a)-(c): :func:`bench.build_megatron.prepare` (``init_megatron``,
``megatron_overrides``, megatron-core DDP + distributed optimizer, ``random_batch``, CUDA graphs, the
CLOCK phases), so the only difference measured is Megatron-Bridge's model and adapters.

What differs from Megatron-Bridge's own training loop, and why:

* no ``Float16Module`` (``mixed_precision_wrapper=None``): (a)-(c) hold bf16 parameters without it, and
  it only casts the first stage's input and the loss;
* ``gradient_accumulation_fusion=False``: the provider turns it on whenever TE imports, but the adapters'
  megatron-core ``ColumnParallelLinear`` then needs apex's ``fused_weight_gradient_mlp_cuda`` (absent on
  the device machine; megatron-core raises when the adapter is built); (a)-(c) have it off too;
* ``seq_length`` is the run's, as the recipes set it (``cfg.model.seq_length``);
* weights are not loaded (``to_megatron_provider(load_weights=False)``: the provider's random init), as
  (c) ``twinkle_lora`` runs; weight values do not change the step's time.

Variants (:data:`VARIANTS`): ``te_fused`` (the default of :func:`lora`) is Megatron-Bridge's fastest
LoRA, ``TEFusedLoRALinear``, which its ``LoRA.transform`` builds when the config's
``use_transformer_engine_op_fuser`` is on (TP 1, not routed experts): base linear (with its RMSNorm) and
adapter as Transformer Engine op-fuser graphs, the ``B`` GEMM scaled and accumulated into the base
output, the base dgrad accumulated into the adapter's. The switch is on only while the transform runs:
model-wide it also changes megatron-core 0.19's modules, the dense MLP into ``TEFusedMLP`` (which rebuilds
itself from ``linear_fc1``/``linear_fc2`` and refuses a wrapped ``linear_fc1``) and the routed experts into
TE's fused grouped MLP (asserts TE >= 2.14 at construction; it would bypass the expert adapters), so
the model is built with it off, from the provider's own layer spec. ``linear`` is the recipes' default
(``LoRALinear`` + ``ParallelLinearAdapter``: TE base layer, adapter in megatron-core
``ColumnParallelLinear``s, ``x * alpha/dim``, an add); ``canonical`` is ``CanonicalLoRA`` (separate
q/k/v and gate/up adapters, the adapters PEFT trains). Routed experts take ``LoRALinear`` in every
variant and share one adapter per projection across the local experts (``share_expert_adapters=True``,
its default: the adapter FLOPs of per-expert adapters, 1/E of their parameters).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import peer_kits
from .build_megatron import prepare
from .device import on_gpu
from .settings import Prepared, Settings

# Megatron-Bridge's LoRA targets on Megatron's fused linears (its LoRA default)
TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# CanonicalLoRA: the same linears split into the adapters of transformers' projections
CANONICAL_TARGET_MODULES = (
    "linear_q",
    "linear_k",
    "linear_v",
    "linear_proj",
    "linear_fc1_up",
    "linear_fc1_gate",
    "linear_fc2",
)
# megatron-bridge 0.6.x is built on megatron-core 0.19 (its r0.6.0 branch pins core_v0.19.0); with 0.16.1
# it fails on import (megatron.core._rank_utils.safe_get_world_size, megatron.training)
MCORE_SERIES = "0.19."


@dataclass(frozen=True)
class BridgeLora:
    """One way Megatron-Bridge applies LoRA."""

    name: str
    canonical: bool  # CanonicalLoRA instead of LoRA
    op_fuser: bool  # use_transformer_engine_op_fuser in the transform: TEFusedLoRALinear (TP 1, not experts)

    def describe(self) -> str:
        if self.canonical:
            return "CanonicalLoRA (LoRALinearSplitQKV / LoRALinearSplitFC1UpGate + ParallelLinearAdapter)"
        if self.op_fuser:
            return (
                "LoRA, TEFusedLoRALinear (use_transformer_engine_op_fuser on for the PEFT transform "
                "only), LoRALinear on routed experts"
            )
        return "LoRA, LoRALinear + ParallelLinearAdapter (use_transformer_engine_op_fuser=False)"


VARIANTS: dict[str, BridgeLora] = {
    v.name: v
    for v in (
        BridgeLora("te_fused", canonical=False, op_fuser=True),
        BridgeLora("linear", canonical=False, op_fuser=False),
        BridgeLora("canonical", canonical=True, op_fuser=False),
    )
}


def _alpha(value: float) -> float | int:
    """Megatron-Bridge types ``alpha`` as int; keep a whole alpha an int (the scale is alpha / dim)."""
    return int(value) if float(value).is_integer() else value


def _peft(variant: BridgeLora, s: Settings):
    """The PEFT object a finetune recipe puts in ``cfg.peft``: rank ``s.lora_r``, ``s.lora_alpha``, no
    dropout, on every linear of the decoder layers."""
    if variant.canonical:
        from megatron.bridge.peft.canonical_lora import CanonicalLoRA

        return CanonicalLoRA(
            target_modules=list(CANONICAL_TARGET_MODULES),
            dim=s.lora_r,
            alpha=_alpha(s.lora_alpha),
            dropout=0.0,
        )
    from megatron.bridge.peft.lora import LoRA

    return LoRA(target_modules=list(TARGET_MODULES), dim=s.lora_r, alpha=_alpha(s.lora_alpha), dropout=0.0)


def _apply_peft(peft, op_fuser: bool, model: list) -> list:
    """Megatron-Bridge's PEFT pre-wrap hook, less its checkpoint load
    (``training.setup._apply_peft_transformation``): freeze, wrap the targets, record the adapters.
    ``op_fuser``: ``use_transformer_engine_op_fuser`` on while the transform picks its wrappers (the
    modules built before it saw it off; see the module doc)."""
    config = model[0].config  # the provider: every module's config
    config.use_transformer_engine_op_fuser = op_fuser
    try:
        model = peft(model, training=True)
    finally:
        config.use_transformer_engine_op_fuser = False
    peft.set_params_to_save(model)
    return model


def _adapter_classes(model) -> dict[str, int]:
    """How many modules of each adapter wrapper class the transform made (what actually runs)."""
    from megatron.bridge.peft.adapter_wrapper import AdapterWrapper

    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, AdapterWrapper):
            name = type(module).__name__
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


# architecture fields that must match what (a)-(c) build from the same config.json
ARCH_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "normalization",
    "gated_linear_unit",
    "qk_layernorm",
    "add_bias_linear",
    "add_qkv_bias",
    "layernorm_epsilon",
    "num_moe_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_router_pre_softmax",
)


def _architecture_mismatches(provider, hf_dir: Path) -> list[str]:
    """Where Megatron-Bridge's provider reads ``config.json`` differently from twinkle_specs (which (a)-(c)
    use): a peer measured on another shape compares nothing. (megatron-bridge 0.3.1 on transformers 5,
    for one, reads ``rotary_base`` 10000 for Qwen3's 1e6.)"""
    from twinkle_specs.config_mapping import transformer_config_from_hf
    from twinkle_specs.hf_config import qwen_arch_from_hf

    ours = transformer_config_from_hf(hf_dir)
    out = [
        f"{k}: bridge {getattr(provider, k, None)!r}, twinkle {getattr(ours, k, None)!r}"
        for k in ARCH_FIELDS
        if getattr(provider, k, None) != getattr(ours, k, None)
    ]
    arch = qwen_arch_from_hf(hf_dir)
    theirs = (float(provider.rotary_base), provider.share_embeddings_and_output_weights, provider.vocab_size)
    mine = (float(arch.rotary_base), arch.tie_word_embeddings, arch.vocab_size)
    for name, a, b in zip(("rotary_base", "tied embeddings", "vocab_size"), theirs, mine, strict=True):
        if a != b:
            out.append(f"{name}: bridge {a!r}, twinkle {b!r}")
    return out


def bridge_model(
    hf_dir: Path, s: Settings, overrides: dict[str, Any], *, variant: BridgeLora
) -> tuple[Any, dict[str, Any]]:
    """The GPTModel Megatron-Bridge builds for ``hf_dir``, with its LoRA applied (see module doc)."""
    peer_kits.activate("megatron_bridge")  # ``megatron`` is a namespace package: .bridge joins .core
    import megatron.bridge
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(str(hf_dir))
    provider = bridge.to_megatron_provider(load_weights=False)
    fields = dict(overrides) | {
        "gradient_accumulation_fusion": False,
        "seq_length": s.seq_len,
        "use_transformer_engine_op_fuser": False,  # on for the PEFT transform only (_apply_peft)
    }
    if not on_gpu():  # the CPU check of this module (local spec); never timed
        fields["use_cpu_initialization"] = True
    not_accepted = sorted(k for k in fields if not hasattr(provider, k))
    provider.apply_overrides_and_finalize(
        dtype=s.torch_dtype(), overrides={k: v for k, v in fields.items() if k not in not_accepted}
    )
    if mismatches := _architecture_mismatches(provider, hf_dir):
        raise ValueError(f"Megatron-Bridge reads {hf_dir / 'config.json'} as another model: {mismatches}")
    peft = _peft(variant, s)
    chunks = provider.provide_distributed_model(
        wrap_with_ddp=False,
        pre_wrap_hook=[functools.partial(_apply_peft, peft, variant.op_fuser)],
        mixed_precision_wrapper=None,
        use_cpu_initialization=not on_gpu(),
    )
    if len(chunks) != 1:
        raise RuntimeError(f"expected one model chunk (no virtual pipeline), got {len(chunks)}")
    model = chunks[0]
    facts: dict[str, Any] = {
        "megatron_bridge_version": megatron.bridge.__version__,
        "bridge_provider": type(provider).__name__,
        "lora_variant": variant.name,
        "lora": {
            "class": type(peft).__name__,
            "target_modules": list(peft.target_modules),
            "dim": peft.dim,
            "alpha": peft.alpha,
            "dropout": peft.dropout,
            "lora_A_init_method": peft.lora_A_init_method,
            "lora_B_init_method": peft.lora_B_init_method,
            "share_expert_adapters": getattr(peft, "share_expert_adapters", None),
            "op_fuser_during_transform": variant.op_fuser,
            "wrappers": _adapter_classes(model),
        },
        "weights": "random init (to_megatron_provider(load_weights=False)); checkpoint not read, as (c)",
        "mixed_precision_wrapper": "none (bf16 parameters, as (a)-(c); Megatron-Bridge wraps in Float16Module)",
        "overrides_not_accepted": not_accepted,
        "bridge_config": {
            k: getattr(provider, k, None)
            for k in (
                "use_transformer_engine_op_fuser",
                "gradient_accumulation_fusion",
                "masked_softmax_fusion",
                "bias_dropout_fusion",
                "persist_layer_norm",
                "attention_backend",
                "attention_softmax_in_fp32",
                "seq_length",
                "should_pad_vocab",
            )
        },
    }
    facts["bridge_config"]["attention_backend"] = str(facts["bridge_config"]["attention_backend"])
    return model, facts


def build(hf_dir: Path, s: Settings, variant: BridgeLora) -> Prepared:
    """One Megatron-Bridge LoRA variant through the harness's Megatron path (:func:`prepare`)."""
    prepared = prepare(hf_dir, s, functools.partial(bridge_model, variant=variant))
    result = prepared.result
    result["transformer_impl"] = result.get("impl")
    result["impl"] = (
        f"megatron-bridge {result['megatron_bridge_version']}: {variant.describe()}, "
        f"dim={s.lora_r}, alpha={_alpha(s.lora_alpha)}"
    )
    return prepared


def lora(hf_dir: Path, s: Settings) -> Prepared:
    """Megatron-Bridge's fastest LoRA (``te_fused``) on all linear layers."""
    return build(hf_dir, s, VARIANTS["te_fused"])


def lora_linear(hf_dir: Path, s: Settings) -> Prepared:
    """Megatron-Bridge's default LoRA path (``LoRALinear``), as its Qwen3 PEFT recipes run it."""
    return build(hf_dir, s, VARIANTS["linear"])


def lora_canonical(hf_dir: Path, s: Settings) -> Prepared:
    """Megatron-Bridge's ``CanonicalLoRA``: PEFT's adapters (q, k, v, o, gate, up, down) on Megatron."""
    return build(hf_dir, s, VARIANTS["canonical"])


def unavailable(hf_dir: Path, s: Settings) -> str | None:
    """Why the Megatron-Bridge LoRA peer cannot run here: no GPU or TE, a megatron-core it was not built
    on, the peer not installed (``bench/peers.sh``), a hybrid shape, or CUDA-graph
    settings it refuses. Imports the peer, so it runs in the variant's own process."""
    peer_kits.activate("megatron_bridge")
    if not on_gpu():
        return "needs a CUDA GPU with Transformer Engine (megatron.bridge.peft.lora_layers imports it)"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as e:
        return f"Transformer Engine does not import: {e}"
    import megatron.core

    if not megatron.core.__version__.startswith(MCORE_SERIES):
        return (
            f"megatron-bridge 0.6.x needs megatron-core {MCORE_SERIES}x; found {megatron.core.__version__} "
            "(stage ../shared/gpu/stage.sh --mcore 0.19.2)"
        )
    try:
        from megatron.bridge import AutoBridge
    except Exception as e:  # an import-time failure of the peer is a skip, recorded with its cause
        return f"megatron.bridge does not import: {type(e).__name__}: {e} ({peer_kits.STAGE})"
    from transformers import AutoConfig

    from twinkle_specs.hf_config import qwen_arch_from_hf

    if qwen_arch_from_hf(hf_dir).hybrid is not None:
        return "this peer is measured on the dense and MoE Qwen shapes only (no Gated DeltaNet)"
    if not AutoBridge.supports(AutoConfig.from_pretrained(hf_dir)):
        return f"AutoBridge has no bridge for {hf_dir / 'config.json'}"
    if s.cuda_graphs == "local":
        return (
            'Megatron-Bridge refuses cuda_graph_impl="local" except for full-iteration graphs '
            "(validate_cuda_graph_configuration)"
        )
    return None
