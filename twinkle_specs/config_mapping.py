"""Turns a Hugging Face Qwen config into Megatron-LM flags and a megatron-core TransformerConfig.

Both come from one table (:func:`_settings`): each entry names the command-line flags and the
TransformerConfig fields that express one fact of the checkpoint, so the flags that
``pretrain_gpt.py`` parses and the config that :func:`build_model` uses cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .hf_config import QwenArch, UnsupportedConfigError, qwen_arch_from_hf

SPEC_FLAGS = ["--spec", "twinkle_specs", "qwen_layer_spec"]
# GPTModel arguments, not TransformerConfig fields (build_model passes them from the QwenArch).
GPT_MODEL_ARGS = ("max_position_embeddings", "rotary_base", "position_embedding_type", "rotary_percent")
# Megatron-LM's YaRN flags (--position-embedding-type yarn, ...) exist from core_v0.19 on. megatron-core's
# own YaRN settings are config attributes that GPTModel and the attention read with getattr (not dataclass
# fields): transformer_config_from_hf sets them on the TransformerConfig after it is built (0.16 and 0.19).
YARN_MIN_MEGATRON = "0.19"
# The config.json field that decides QKV bias, by family (Qwen2 always has it).
_QKV_BIAS_SOURCE = {"qwen2": "model_type", "qwen2_moe": "qkv_bias"}


@dataclass(frozen=True)
class Setting:
    """One fact of the checkpoint: the flags that say it, the TransformerConfig fields they set, the
    config.json field it comes from, and the further Megatron-LM flags it rules out (which must keep
    Megatron's default). The launcher checks every flag a setting names against Megatron's parsed args.
    """

    flags: list[str]
    config: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    governs: tuple[str, ...] = ()

    @property
    def arch_flags(self) -> list[str]:
        """Every flag whose parsed value this fact determines."""
        return [t for t in self.flags if t.startswith("--")] + [
            f for f in self.governs if f not in self.flags
        ]


def _switch(
    flag: str, on: bool, config: dict[str, Any], source: str, governs: tuple[str, ...] = ()
) -> Setting:
    """A store-true flag the checkpoint needs on or off (off: the flag must not be given)."""
    return Setting([flag] if on else [], config, source, (flag, *governs))


def _settings(arch: QwenArch) -> list[Setting]:
    s = [
        Setting(
            ["--num-layers", str(arch.num_layers)],
            {"num_layers": arch.num_layers},
            "num_hidden_layers",
            ("--encoder-num-layers", "--decoder-num-layers"),
        ),
        Setting(["--hidden-size", str(arch.hidden_size)], {"hidden_size": arch.hidden_size}, "hidden_size"),
        Setting(
            ["--ffn-hidden-size", str(arch.ffn_hidden_size)],
            {"ffn_hidden_size": arch.ffn_hidden_size},
            "intermediate_size",
        ),
        Setting(
            ["--num-attention-heads", str(arch.num_attention_heads)],
            {"num_attention_heads": arch.num_attention_heads},
            "num_attention_heads",
        ),
        Setting(
            ["--group-query-attention", "--num-query-groups", str(arch.num_query_groups)],
            {"num_query_groups": arch.num_query_groups},
            "num_key_value_heads",
        ),
        Setting(["--kv-channels", str(arch.kv_channels)], {"kv_channels": arch.kv_channels}, "head_dim"),
        Setting(
            ["--normalization", "RMSNorm", "--norm-epsilon", repr(arch.norm_epsilon)],
            {"normalization": "RMSNorm", "layernorm_epsilon": arch.norm_epsilon},
            "rms_norm_eps",
        ),
        Setting(
            ["--swiglu"],
            {"gated_linear_unit": True, "activation_func": F.silu},
            "hidden_act",
            (
                "--squared-relu",
                "--quick-geglu",
                "--openai-gelu",
                "--glu-linear-offset",
                "--activation-func-clamp-value",
                "--moe-mlp-glu-interleave-size",
            ),
        ),
        Setting(["--disable-bias-linear"], {"add_bias_linear": False}, "architectures"),
        _switch(
            "--add-qkv-bias",
            arch.qkv_bias,
            {"add_qkv_bias": arch.qkv_bias},
            _QKV_BIAS_SOURCE.get(arch.family, "attention_bias"),
        ),
        _switch(
            "--qk-layernorm",
            arch.qk_layernorm,
            {"qk_layernorm": arch.qk_layernorm},
            "model_type",
            ("--qk-l2-norm",),
        ),
        _rope_setting(arch),
        Setting(
            ["--max-position-embeddings", str(arch.max_position_embeddings)],
            {"max_position_embeddings": arch.max_position_embeddings},
            "max_position_embeddings",
        ),
        Setting(
            ["--attention-dropout", repr(arch.attention_dropout), "--hidden-dropout", "0.0"],
            {"attention_dropout": arch.attention_dropout, "hidden_dropout": 0.0},
            "attention_dropout",
        ),
        Setting(
            ["--init-method-std", repr(arch.init_method_std)],
            {"init_method_std": arch.init_method_std},
            "initializer_range",
        ),
        _switch(
            "--untie-embeddings-and-output-weights",
            not arch.tie_word_embeddings,
            {},
            "tie_word_embeddings",
        ),
        Setting([], source="use_sliding_window", governs=("--window-size", "--window-attn-skip-freq")),
        # What no Qwen of these families has: each flag must keep Megatron-LM's default.
        Setting(
            [],
            source="architectures",
            governs=(
                "--apply-layernorm-1p",  # transformers' Qwen RMSNorm multiplies by the weight itself
                "--apply-residual-connection-post-layernorm",
                "--multi-latent-attention",
                "--experimental-attention-variant",
                "--linear-attention-freq",
                "--attention-output-gate",
                "--softmax-type",
                "--mtp-num-layers",
                "--heterogeneous-layers-config-path",
                "--heterogeneous-layers-config-encoded-json",
                "--use-mup",
            ),
        ),
    ]
    if arch.dtype == "bfloat16":
        s.append(Setting(["--bf16"], {"bf16": True, "params_dtype": torch.bfloat16}, "dtype"))
    elif arch.dtype == "float16":
        s.append(Setting(["--fp16"], {"fp16": True, "params_dtype": torch.float16}, "dtype"))
    if arch.hybrid is not None:
        s = _with_hybrid(s, _hybrid_settings(arch))
    if not arch.is_moe:
        return s + [Setting([], source="architectures", governs=("--num-experts",))]
    s += [
        Setting(
            ["--num-experts", str(arch.num_experts)],
            {"num_moe_experts": arch.num_experts},
            "num_experts",
            ("--moe-latent-size",),
        ),
        Setting([], source="decoder_sparse_step", governs=("--moe-layer-freq",)),
        Setting(
            ["--moe-router-topk", str(arch.moe_router_topk)],
            {"moe_router_topk": arch.moe_router_topk},
            "num_experts_per_tok",
            (
                "--moe-router-score-function",
                "--moe-router-topk-scaling-factor",
                "--moe-router-num-groups",
                "--moe-router-group-topk",
                "--moe-router-enable-expert-bias",
                "--moe-apply-probs-on-input",
            ),
        ),
        Setting(
            ["--moe-ffn-hidden-size", str(arch.moe_ffn_hidden_size)],
            {"moe_ffn_hidden_size": arch.moe_ffn_hidden_size},
            "moe_intermediate_size",
        ),
        Setting(
            [
                "--moe-router-load-balancing-type",
                "aux_loss",
                "--moe-aux-loss-coeff",
                repr(arch.moe_aux_loss_coeff),
            ],
            {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": arch.moe_aux_loss_coeff},
            "router_aux_loss_coef",
        ),
        _switch(
            "--moe-router-pre-softmax",
            not arch.norm_topk_prob,
            {"moe_router_pre_softmax": True} if not arch.norm_topk_prob else {},
            "norm_topk_prob",
        ),
    ]
    shared = arch.shared_expert_intermediate_size
    s.append(
        Setting(
            ["--moe-shared-expert-intermediate-size", str(shared), "--moe-shared-expert-gate"]
            if shared
            else [],
            {"moe_shared_expert_intermediate_size": shared, "moe_shared_expert_gate": True} if shared else {},
            "shared_expert_intermediate_size",
            ("--moe-shared-expert-intermediate-size", "--moe-shared-expert-gate"),
        )
    )
    return s


def _hybrid_settings(arch: QwenArch) -> list[Setting]:
    """Qwen3-Next / Qwen3.5: Gated DeltaNet layers where ``layer_types`` says linear_attention (megatron-core's
    ``linear_attention_freq`` list, 1 = linear), gated full attention, zero-centred norms, partial RoPE.
    TE's fused RoPE is left off (--no-rope-fusion), as in megatron-core's own Qwen3-Next recipes."""
    h = arch.hybrid
    assert h is not None
    pattern = "[" + ",".join(str(v) for v in h.linear_attention_pattern) + "]"
    return [
        Setting(["--apply-layernorm-1p"], {"layernorm_zero_centered_gamma": True}, "model_type"),
        Setting(["--attention-output-gate"], {"attention_output_gate": True}, "attn_output_gate"),
        Setting(
            ["--rotary-percent", repr(h.rotary_percent), "--no-rope-fusion"],
            {"rotary_percent": h.rotary_percent},
            "partial_rotary_factor",
        ),
        Setting(
            [
                "--experimental-attention-variant",
                "gated_delta_net",
                "--linear-attention-freq",
                pattern,
                "--linear-conv-kernel-dim",
                str(h.conv_kernel),
                "--linear-key-head-dim",
                str(h.key_head_dim),
                "--linear-value-head-dim",
                str(h.value_head_dim),
                "--linear-num-key-heads",
                str(h.num_key_heads),
                "--linear-num-value-heads",
                str(h.num_value_heads),
            ],
            {
                "experimental_attention_variant": "gated_delta_net",
                "linear_attention_freq": h.linear_attention_pattern,
                "linear_conv_kernel_dim": h.conv_kernel,
                "linear_key_head_dim": h.key_head_dim,
                "linear_value_head_dim": h.value_head_dim,
                "linear_num_key_heads": h.num_key_heads,
                "linear_num_value_heads": h.num_value_heads,
            },
            "layer_types",
        ),
    ]


def _with_hybrid(settings: list[Setting], hybrid: list[Setting]) -> list[Setting]:
    """The hybrid facts added, and the flags they set no longer ruled out by the dense table's entries
    (which require Megatron's default for them: no other Qwen has gated or linear attention)."""
    set_here = {f for h in hybrid for f in h.arch_flags}
    kept = [
        Setting(s.flags, s.config, s.source, tuple(f for f in s.governs if f not in set_here))
        for s in settings
    ]
    return kept + hybrid


def _rope_setting(arch: QwenArch) -> Setting:
    # Megatron-LM parses --rotary-base as an int; the launcher hands GPTModel a fractional rope_theta
    # itself (launch._exact_rotary_base), build_model uses the config's value.
    flags = [
        "--position-embedding-type",
        arch.position_embedding_type,
        "--rotary-base",
        str(int(arch.rotary_base)),
    ]
    config: dict[str, Any] = {
        "rotary_base": arch.rotary_base,
        "position_embedding_type": arch.position_embedding_type,
    }
    yarn = arch.yarn
    source = yarn.field if yarn is not None else "rope_parameters"
    governs = (
        "--rotary-interleaved",  # transformers rotates the two halves of each head, not interleaved pairs
        "--rotary-percent",  # partial_rotary_factor must be 1.0
        "--rotary-seq-len-interpolation-factor",
        "--use-rope-scaling",
        "--no-rope-freq",
        "--no-position-embedding",
        "--rope-type",
    )
    if yarn is None:
        return Setting(flags, config, source, governs)
    # Megatron-LM core_v0.19's flags; its argument_utils._apply_yarn_config_from_args copies them to the
    # config's yarn_* attributes. The attention scales RoPE's cos/sin by the concentration factor from
    # (factor, mscale, mscale_all_dim); TE's fused RoPE cannot (bshd falls back to unfused with a
    # warning, packed-sequence thd drops it), hence --no-rope-fusion.
    round_flag = "--yarn-correction-range-round-to-int"
    flags += [
        "--rotary-scaling-factor",
        repr(yarn.factor),
        "--yarn-original-max-position-embeddings",
        str(yarn.original_max_position_embeddings),
        "--yarn-beta-fast",
        repr(yarn.beta_fast),
        "--yarn-beta-slow",
        repr(yarn.beta_slow),
        "--mscale",
        repr(yarn.mscale),
        "--mscale-all-dim",
        repr(yarn.mscale_all_dim),
        round_flag if yarn.correction_range_round_to_int else round_flag.replace("--", "--no-", 1),
        "--no-rope-fusion",
    ]
    config |= {
        "yarn_rotary_scaling_factor": yarn.factor,
        "yarn_original_max_position_embeddings": yarn.original_max_position_embeddings,
        "yarn_beta_fast": yarn.beta_fast,
        "yarn_beta_slow": yarn.beta_slow,
        "yarn_mscale": yarn.mscale,
        "yarn_mscale_all_dim": yarn.mscale_all_dim,
        "yarn_correction_range_round_to_int": yarn.correction_range_round_to_int,
        "apply_rope_fusion": False,
    }
    return Setting(flags, config, source, governs)


def flag_values(tokens: list[str]) -> dict[str, list[str]]:
    """``--flag v1 v2 --switch --key=v`` -> {"--flag": ["v1", "v2"], "--switch": [], "--key": ["v"]}."""
    out: dict[str, list[str]] = {}
    key = None
    for tok in tokens:
        if tok.startswith("--"):
            key, _, inline = tok.partition("=")
            out[key] = [inline] if inline else []
        elif key is not None:
            out[key].append(tok)
    return out


def installed_megatron_core() -> str:
    """The version of the megatron-core this process imports (a checkout on PYTHONPATH counts)."""
    import megatron.core

    return megatron.core.__version__


def megatron_args_from_hf(hf_dir: str | Path, *, megatron_version: str | None = None) -> list[str]:
    """Megatron-LM flags describing this checkpoint, ending with ``--spec twinkle_specs qwen_layer_spec``.

    Training choices (parallelism, batch, lr, seq-length, tokenizer) are the user's and are not included.
    A YaRN checkpoint needs Megatron-LM core_v0.19+ (its ``--position-embedding-type yarn`` and YaRN
    flags): with an older ``megatron_version`` (default: the installed megatron-core) this raises.
    """
    arch = qwen_arch_from_hf(hf_dir)
    if arch.yarn is not None:
        from packaging.version import Version

        version = megatron_version or installed_megatron_core()
        if Version(version) < Version(YARN_MIN_MEGATRON):
            raise UnsupportedConfigError(
                f"{Path(hf_dir) / 'config.json'}: {arch.yarn.field}.rope_type='yarn' needs Megatron-LM "
                f"core_v0.19+ for the flags (--position-embedding-type yarn --rotary-scaling-factor ...); "
                f"megatron-core here is {version}. build_model / transformer_config_from_hf (our own "
                "GPTModel construction) support YaRN on this version."
            )
    flags = [f for setting in _settings(arch) for f in setting.flags]
    # The embedding is padded to a multiple of this times TP; Qwen vocabularies are multiples of 128.
    flags += ["--make-vocab-size-divisible-by", "128" if arch.vocab_size % 128 == 0 else "1"]
    return flags + SPEC_FLAGS


def architecture_settings(hf_dir: str | Path) -> list[Setting]:
    """The checkpoint's facts (:class:`Setting`), for checking a parsed Megatron command line against."""
    return _settings(qwen_arch_from_hf(hf_dir))


def _config_fields(arch: QwenArch) -> dict[str, Any]:
    """TransformerConfig fields and ``yarn_*`` attributes (no GPTModel arguments)."""
    fields: dict[str, Any] = {}
    for setting in _settings(arch):
        fields.update(setting.config)
    for name in GPT_MODEL_ARGS:
        fields.pop(name, None)
    return fields


def _runtime_fields() -> dict[str, Any]:
    """Fields that depend on this process (parallel layout, device), not on the checkpoint."""
    from megatron.core import parallel_state as ps

    on_gpu = torch.cuda.is_available()
    fields: dict[str, Any] = {
        "use_cpu_initialization": not on_gpu,
        "gradient_accumulation_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "transformer_impl": "transformer_engine" if on_gpu and _te_available() else "local",
    }
    if ps.model_parallel_is_initialized():
        fields |= {
            "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
            "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        }
    return fields


def _te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_config_from_hf(hf_dir: str | Path, **overrides: Any):
    """A megatron-core TransformerConfig for this checkpoint; ``overrides`` win over everything.

    Parallel sizes are read from megatron's parallel state when it is initialized; fusions that need
    CUDA kernels are off unless overridden; ``transformer_impl`` is "transformer_engine" when a GPU and
    TE are present, otherwise "local" (the portable path that runs on CPU). A YaRN checkpoint's
    ``yarn_*`` settings are set as attributes of the config (where megatron-core's GPTModel and
    attention read them, on 0.16 and 0.19 alike); build the GPTModel with
    ``position_embedding_type=arch.position_embedding_type`` (as :func:`build_model` does).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch = qwen_arch_from_hf(hf_dir)
    kwargs = _config_fields(arch) | _runtime_fields() | overrides
    yarn_attrs = {name: kwargs.pop(name) for name in list(kwargs) if name.startswith("yarn_")}
    if arch.yarn is not None and kwargs.get("apply_rope_fusion"):
        raise ValueError(
            f"{Path(hf_dir) / 'config.json'}: apply_rope_fusion=True with YaRN: TE's fused RoPE cannot apply "
            f"YaRN's attention factor {arch.yarn.attention_factor} on packed sequences; leave it off"
        )
    kwargs.setdefault("pipeline_dtype", kwargs.get("params_dtype", torch.float32))
    if arch.is_moe:
        # alltoall is the fast path on GPUs; allgather is the dispatcher that runs without CUDA streams.
        kwargs.setdefault(
            "moe_token_dispatcher_type", "alltoall" if torch.cuda.is_available() else "allgather"
        )
    for name in ("num_attention_heads", "num_query_groups"):
        tp = kwargs.get("tensor_model_parallel_size", 1)
        if kwargs[name] % tp:
            raise ValueError(
                f"{Path(hf_dir) / 'config.json'}: {name}={kwargs[name]} is not divisible by "
                f"tensor_model_parallel_size={tp}; choose a TP size that divides both the attention heads "
                f"({arch.num_attention_heads}) and the KV groups ({arch.num_query_groups})."
            )
    for name in ("linear_num_key_heads", "linear_num_value_heads") if arch.hybrid is not None else ():
        tp = kwargs.get("tensor_model_parallel_size", 1)
        if kwargs[name] % tp:
            raise ValueError(
                f"{Path(hf_dir) / 'config.json'}: {name}={kwargs[name]} is not divisible by "
                f"tensor_model_parallel_size={tp}: megatron-core splits the Gated DeltaNet heads over TP; "
                f"choose a TP size that divides its key ({arch.hybrid.num_key_heads}) and value "
                f"({arch.hybrid.num_value_heads}) heads."
            )
    config = TransformerConfig(**kwargs)
    for name, value in yarn_attrs.items():
        setattr(config, name, value)
    return config
