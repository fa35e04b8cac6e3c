"""A benchmark peer: ModelScope's Megatron LoRA, as ``megatron sft --tuner_type lora`` of ms-swift 4.x
runs it. ms-swift builds the megatron-core GPTModel through mcore-bridge (``hf_to_mcore_config`` ->
``ModelConfig`` -> ``get_mcore_model``: megatron-core's TE decoder block spec with mcore-bridge's own
GPTModel, TransformerBlock, TransformerLayer and TopKRouter subclasses), adds the adapters with
``swift.megatron.utils.prepare_mcore_model`` (peft's ``get_peft_model`` with ms-swift's LoraConfig on every
TE linear but the output layer; mcore-bridge's ``LoraParallelLinear``, registered into peft as its
``dispatch_megatron``, wraps each one with two TE linears) and wraps the model in megatron-core's
``Float16Module``, whose ``module.bfloat16()`` casts peft's fp32 adapters back to bf16. All three are called
here, not re-implemented.

ms-swift's trainer itself is not driven (it wants its dataset/template pipeline, tokenizer and CLI
arguments): DDP, the optimizer, the data and the step are the harness's (:func:`bench.build_megatron.prepare`:
``init_megatron``, ``megatron_overrides``, megatron-core DDP + distributed optimizer, ``random_batch``,
the forward/backward/optimizer phases), so only the model and its adapters differ from (c). Weights are
random (megatron's seeded init, ``perform_initialization=True``), as (c)'s; ms-swift would load the HF
checkpoint through ``bridge.load_weights`` instead, which changes no timing. The kit (mcore-bridge,
ms-swift and the import closure of this path, with peft 0.20: both pin ``peft<0.21``) is installed by
``bench/peers.sh install`` into its own folder (:mod:`bench.peer_kits`), put first on ``sys.path`` here, so
that no other variant sees its peft. Not interleavable: importing mcore-bridge patches megatron-core and peft for the
whole process.
"""

from __future__ import annotations

import copy
import importlib.metadata
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from . import peer_kits
from .device import on_gpu
from .settings import Prepared, Settings, hf_model_type

# ms-swift's MegatronArguments defaults for the LoRA tuner, but the dropout: (c) and (d) train without
# one, and ms-swift's 0.05 would add a dropout kernel over every adapter input
SWIFT_LORA_ARGS = {
    "tuner_type": "lora",
    "target_modules": ["all-linear"],
    "modules_to_save": [],
    "lora_bias": "none",
    "lora_dtype": None,  # peft upcasts the adapters to fp32, Float16Module casts them back to bf16
    "use_rslora": False,
    "lora_dropout": 0.0,
    "mcore_ref_adapter": None,
    "ref_adapters": [],
    "is_multimodal": False,
    "language_model_only": False,
    "task_type": "causal_lm",
}

# ms-swift CLI defaults (MegatronArguments, its DDP config) left at the harness's values here, so that the
# step does the same work as (a)-(c) (recorded in the result; --set FIELD=VALUE sets a TransformerConfig
# field for every Megatron variant alike)
SWIFT_DEFAULTS_NOT_APPLIED = {
    "recompute_granularity": "selective (recompute_modules=['core_attn']: attention recomputed in backward)",
    "attention_backend": "flash (needs the flash-attn package, absent here; auto lets TE pick cuDNN)",
    "apply_rope_fusion": False,
    "cross_entropy_fusion_impl": "native",
    "moe_permute_fusion": False,
    "bias_dropout_fusion": True,
    "masked_softmax_fusion": True,
    "gradient_accumulation_fusion": True,
    "lora_dropout": 0.05,
    "moe_aux_loss_coeff": 0.0,
    "ddp_check_for_nan_in_grad": "True (a host sync per gradient bucket)",
}


def _activate_kit() -> str | None:
    """Puts the kit first on ``sys.path`` (its peft 0.20 must win over the image's 0.21, so before anything
    imports peft); says why not where it cannot."""
    site = peer_kits.activate("mcore_bridge")
    if site is None:
        return None
    loaded = sys.modules.get("peft")
    if loaded is not None and not str(getattr(loaded, "__file__", "")).startswith(str(site)):
        return f"peft {loaded.__version__} was imported before the kit's (this process): that one is used"
    return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def unavailable(hf_dir: Path, s: Settings) -> str | None:
    """Why the peer cannot run here: its LoRA layers are TE modules (CUDA + Transformer Engine), the kit
    must be installed, and mcore-bridge must know the checkpoint's model_type (it maps the multimodal
    qwen3_5 / qwen3_5_moe, not the text-only qwen3_5_text of the hybrid shapes)."""
    if not on_gpu():
        return "needs a CUDA GPU with Transformer Engine (mcore-bridge's LoraParallelLinear wraps TE linears)"
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return "Transformer Engine is not installed"
    _activate_kit()
    try:
        from mcore_bridge.model import get_mcore_model_type
    except Exception as err:  # an import error of the kit is a reason to skip, not to stop the run
        kit = peer_kits.kit_dir("mcore_bridge")
        return (
            f"mcore-bridge does not import ({type(err).__name__}: {err}); kit folder {kit}: {peer_kits.STAGE}"
        )
    kind = hf_model_type(hf_dir)
    if get_mcore_model_type(kind) is None:
        return f"mcore-bridge {_version('mcore-bridge')} has no model for model_type {kind!r}"
    return None


def _swift_prepare(model, s: Settings) -> tuple[Any, str]:
    """ms-swift's own adapter step (``prepare_mcore_model``: all-linear -> its ``find_all_linears``,
    its LoraConfig, ``Swift.prepare_model``); plain ``peft.get_peft_model`` with the same targets (what
    mcore-bridge's README does) where ms-swift does not import, said in the result."""
    from types import SimpleNamespace

    try:
        from swift.megatron.utils import prepare_mcore_model
    except Exception as err:  # recorded in the result: a partial ms-swift import is no reason to stop
        import peft
        from megatron.core.extensions.transformer_engine import (
            TEGroupedLinear,
            TELayerNormColumnParallelLinear,
            TELinear,
        )

        linear = (TELinear, TELayerNormColumnParallelLinear, TEGroupedLinear)
        targets = sorted(
            {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, linear)}
            - {"output_layer"}
        )
        config = peft.LoraConfig(
            task_type="CAUSAL_LM",
            r=s.lora_r,
            lora_alpha=s.lora_alpha,
            lora_dropout=0.0,
            target_modules=targets,
        )
        return peft.get_peft_model(model, config), f"peft.get_peft_model (ms-swift does not import: {err})"
    args = SimpleNamespace(**copy.deepcopy(SWIFT_LORA_ARGS), lora_rank=s.lora_r, lora_alpha=s.lora_alpha)
    return prepare_mcore_model(args, model), "swift.megatron.utils.prepare_mcore_model"


def _lora_facts(model) -> dict[str, Any]:
    """What wraps what: each LoRA layer's base module and its A/B factor types, the adapters' dtypes."""
    from mcore_bridge.tuners import LoraParallelLinear

    kinds: Counter[str] = Counter()
    dtypes: set[str] = set()
    other: Counter[str] = Counter()
    for _, m in model.named_modules():
        if isinstance(m, LoraParallelLinear):
            a, b = m.lora_A["default"], m.lora_B["default"]
            kinds[f"{type(m.get_base_layer()).__name__}: A {type(a).__name__}, B {type(b).__name__}"] += 1
            dtypes |= {str(p.dtype).removeprefix("torch.") for p in (*a.parameters(), *b.parameters())}
        elif hasattr(m, "lora_A") and hasattr(m, "base_layer"):
            other[type(m).__name__] += 1
    facts: dict[str, Any] = {"lora_modules": dict(kinds), "adapter_dtypes": sorted(dtypes)}
    if other:
        facts["lora_modules_not_mcore_bridge"] = dict(other)
    return facts


def bridge_model(hf_dir: Path, s: Settings, overrides: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The GPTModel from mcore-bridge (HF config -> ModelConfig -> ``get_mcore_model``) with the harness's
    fusions, then ms-swift's LoRA (the base frozen by peft), in a ``Float16Module`` as ms-swift's
    ``wrap_model`` hands it to DDP (the PeftModel is only ms-swift's handle for saving)."""
    peft_note = _activate_kit()
    import mcore_bridge
    import peft
    from mcore_bridge import ModelConfig, get_mcore_model, hf_to_mcore_config
    from megatron.core.transformer.module import Float16Module
    from transformers import AutoConfig

    from twinkle_specs.hf_config import qwen_arch_from_hf

    arch = qwen_arch_from_hf(hf_dir)
    kwargs = hf_to_mcore_config(AutoConfig.from_pretrained(hf_dir))
    # random weights as (c); mcore-bridge defaults to False and loads the checkpoint instead
    kwargs["perform_initialization"] = True
    if arch.is_moe:
        # mcore-bridge does not map router_aux_loss_coef (ms-swift's default is 0, its Qwen3-MoE examples
        # pass 1e-3): the arch's value, as (a)-(c), so that the router does the same work
        kwargs["moe_aux_loss_coeff"] = arch.moe_aux_loss_coeff
    config = ModelConfig(**(kwargs | overrides))
    model = get_mcore_model(config)[0]
    peft_model, api = _swift_prepare(model, s)
    # ms-swift's wrap_model: Float16Module for bf16/fp16, its module.bfloat16() casting the adapters too
    wrapped = Float16Module(config, model) if config.bf16 or config.fp16 else model
    swift_version = _version("ms-swift")
    facts: dict[str, Any] = {
        # not "peer": the harness's key for the framework's name (report.py's best_peer)
        "peer_versions": {
            "mcore-bridge": mcore_bridge.__version__,
            "ms-swift": swift_version if api.startswith("swift") else None,
            "peft": peft.__version__,
            "modelscope": _version("modelscope"),
        },
        "spec": "megatron-core get_gpt_decoder_block_spec(use_transformer_engine=True) through mcore-bridge's "
        f"ModelLoader ({type(model).__module__}.{type(model).__name__}, its TransformerBlock, TransformerLayer "
        "and TopKRouter)",
        "lora_api": api,
        "lora_targets": sorted(peft_model.peft_config["default"].target_modules),
        "lora_dropout": peft_model.peft_config["default"].lora_dropout,
        "init": "random: megatron's seeded init (perform_initialization=True), no checkpoint load",
        "wrapper": type(wrapped).__name__,
        "peer_config": {
            k: getattr(config, k, None)
            for k in ("moe_router_dtype", "moe_aux_loss_coeff", "attention_backend", "recompute_granularity")
        },
        "ms_swift_defaults_not_applied": SWIFT_DEFAULTS_NOT_APPLIED,
    }
    facts["peer_config"]["attention_backend"] = str(facts["peer_config"]["attention_backend"])
    if peft_note:
        facts["peft_note"] = peft_note
    return wrapped, facts | _lora_facts(model)


def lora(hf_dir: Path, s: Settings) -> Prepared:
    """ModelScope's LoRA r=``s.lora_r`` on all linear layers, trained by the harness's Megatron step."""
    from .build_megatron import prepare

    prepared = prepare(hf_dir, s, bridge_model)
    r = prepared.result
    peer = r["peer_versions"]
    swift = f" + ms-swift {peer['ms-swift']}" if peer["ms-swift"] else ""
    r["impl"] = (
        f"ModelScope mcore-bridge {peer['mcore-bridge']}{swift} LoRA (peft {peer['peft']}), {r['impl']}"
    )
    return prepared
