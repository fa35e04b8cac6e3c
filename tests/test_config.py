"""config.json -> Megatron flags / TransformerConfig, and the errors for what we cannot honour."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import twinkle_specs as ts
from twinkle_specs.hf_config import FIELD_POLICY, UnsupportedConfigError


def _flag_value(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def _edit(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_qwen3_flags(checkpoints):
    flags = ts.megatron_args_from_hf(checkpoints("qwen3"))
    assert flags[-3:] == ["--spec", "twinkle_specs", "qwen_layer_spec"]
    assert _flag_value(flags, "--kv-channels") == "24"  # head_dim independent of hidden/heads
    assert _flag_value(flags, "--num-query-groups") == "2"
    assert "--qk-layernorm" in flags and "--add-qkv-bias" not in flags
    assert "--untie-embeddings-and-output-weights" in flags
    assert _flag_value(flags, "--norm-epsilon") == "1e-06"


def test_qwen2_flags_have_qkv_bias_and_tied_embeddings(checkpoints):
    flags = ts.megatron_args_from_hf(checkpoints("qwen2"))
    assert "--add-qkv-bias" in flags and "--qk-layernorm" not in flags
    assert "--untie-embeddings-and-output-weights" not in flags
    assert _flag_value(flags, "--rotary-base") == "10000"


@pytest.mark.parametrize(
    "kind,pre_softmax,shared",
    [("qwen3_moe", False, False), ("qwen3_moe_nonorm", True, False), ("qwen2_moe", True, True)],
)
def test_moe_flags(kind, pre_softmax, shared, checkpoints):
    flags = ts.megatron_args_from_hf(checkpoints(kind))
    assert _flag_value(flags, "--num-experts") == "4"
    assert _flag_value(flags, "--moe-router-topk") == "2"
    assert _flag_value(flags, "--moe-ffn-hidden-size") == "32"
    assert ("--moe-router-pre-softmax" in flags) == pre_softmax  # norm_topk_prob false <-> pre-softmax
    assert ("--moe-shared-expert-gate" in flags) == shared


def test_transformer_config_matches_flags(checkpoints):
    cfg = ts.transformer_config_from_hf(checkpoints("qwen2_moe"), num_layers=2)
    assert cfg.num_layers == 2  # overrides win
    assert cfg.kv_channels == 16 and cfg.num_query_groups == 2 and cfg.add_qkv_bias
    assert cfg.num_moe_experts == 4 and cfg.moe_router_pre_softmax and cfg.moe_shared_expert_gate
    assert cfg.moe_shared_expert_intermediate_size == 48 and cfg.layernorm_epsilon == 1e-6
    assert cfg.normalization == "RMSNorm" and cfg.gated_linear_unit and not cfg.add_bias_linear


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 4.0, "rope_theta": 1e6}},
            "rope_parameters.rope_type",
        ),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({"rope_parameters": {"rope_type": "default", "factor": 4.0}}, "rope_parameters.factor"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "low_freq_factor": 1}},
            "rope_parameters.low_freq_factor",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}}, "rope_parameters.full_attention"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 1.0, "attention_factor": 1.3}},
            "rope_parameters.attention_factor",
        ),
        ({"rope_parameters": {"rope_type": "yarn", "factor": "4"}}, "rope_parameters.factor"),
        ({"some_new_field": 1}, "some_new_field"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_unsupported_config_fields_are_named(changes, field, checkpoints, tmp_path):
    bad = _edit(checkpoints("qwen3"), tmp_path / "bad", **changes)
    with pytest.raises(UnsupportedConfigError, match=field):
        ts.megatron_args_from_hf(bad)


def test_moe_layer_patterns_rejected(checkpoints, tmp_path):
    bad = _edit(checkpoints("qwen3_moe"), tmp_path / "bad", mlp_only_layers=[0])
    with pytest.raises(UnsupportedConfigError, match="mlp_only_layers"):
        ts.megatron_args_from_hf(bad)


def test_yarn_config(checkpoints):
    """YaRN's settings are yarn_* attributes of the TransformerConfig (megatron-core reads them with
    getattr); transformers' explicit attention_factor becomes megatron-core's mscale."""
    import math

    cfg = ts.transformer_config_from_hf(checkpoints("qwen2_yarn"))
    assert cfg.yarn_rotary_scaling_factor == 3.0 and cfg.yarn_original_max_position_embeddings == 32
    assert cfg.yarn_beta_fast == 16.0 and cfg.yarn_beta_slow == 2.0 and cfg.yarn_correction_range_round_to_int
    assert cfg.yarn_mscale_all_dim == 0.0
    assert math.isclose(0.1 * cfg.yarn_mscale * math.log(3.0) + 1.0, 1.25, rel_tol=1e-12)
    assert not cfg.apply_rope_fusion
    assert not hasattr(ts.transformer_config_from_hf(checkpoints("qwen3")), "yarn_rotary_scaling_factor")


def test_tp_must_divide_kv_groups(checkpoints):
    with pytest.raises(
        ValueError, match="num_query_groups=2 is not divisible by tensor_model_parallel_size=4"
    ):
        ts.transformer_config_from_hf(checkpoints("qwen3"), tensor_model_parallel_size=4)


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ts.megatron_args_from_hf(tmp_path)


def test_every_saved_field_has_a_policy(checkpoints):
    for kind in ("qwen2", "qwen2_5", "qwen3", "qwen3_moe", "qwen2_moe", "qwen3_yarn", "qwen2_yarn"):
        cfg = json.loads((checkpoints(kind) / "config.json").read_text())
        assert set(cfg) <= set(FIELD_POLICY), set(cfg) - set(FIELD_POLICY)


def test_config_fields_doc_is_current():
    from twinkle_specs.docs import config_fields_markdown

    doc = Path(__file__).parent.parent / "docs" / "config-fields.md"
    assert doc.read_text() == config_fields_markdown(), (
        "regenerate: python -m twinkle_specs.docs > docs/config-fields.md"
    )


def test_cli_args_prints_flags(checkpoints):
    out = subprocess.run(
        [sys.executable, "-m", "twinkle_specs.cli", "args", "--hf-model", str(checkpoints("qwen3"))],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip().endswith("--spec twinkle_specs qwen_layer_spec")


def test_cli_error_names_the_problem(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "twinkle_specs.cli", "args", "--hf-model", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "config.json" in proc.stderr


# Fields that may be left out of config.json (transformers fills them in from its config class).
OPTIONAL = (
    "head_dim",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "rope_theta",
    "initializer_range",
    "attention_dropout",
    "norm_topk_prob",
    "router_aux_loss_coef",
    "qkv_bias",
    "shared_expert_intermediate_size",
)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_absent_fields_are_read_as_transformers_reads_them(kind, checkpoints, tmp_path):
    """With every optional field left out, each architecture fact equals what transformers' own config
    class resolves (Qwen3's head_dim is its class default 128, not hidden_size / heads)."""
    from transformers import AutoConfig

    from twinkle_specs.hf_config import qwen_arch_from_hf

    stripped = _edit(checkpoints(kind), tmp_path / "stripped", **dict.fromkeys(OPTIONAL))
    arch = qwen_arch_from_hf(stripped)
    hf = AutoConfig.from_pretrained(stripped)
    assert arch.kv_channels == getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads)
    assert arch.num_query_groups == hf.num_key_value_heads
    if kind in ("qwen2", "qwen3"):  # their classes turn a null num_key_value_heads into the head count
        nulled = Path(shutil.copytree(stripped, tmp_path / "null-kv"))
        cfg = json.loads((nulled / "config.json").read_text()) | {"num_key_value_heads": None}
        (nulled / "config.json").write_text(json.dumps(cfg))
        assert (
            qwen_arch_from_hf(nulled).num_query_groups
            == AutoConfig.from_pretrained(nulled).num_key_value_heads
            == 4
        )
    assert arch.norm_epsilon == hf.rms_norm_eps and arch.tie_word_embeddings == hf.tie_word_embeddings
    assert arch.rotary_base == hf.rope_parameters["rope_theta"]
    assert arch.init_method_std == hf.initializer_range and arch.attention_dropout == hf.attention_dropout
    if kind == "qwen3":
        assert arch.kv_channels == 128 != hf.hidden_size // hf.num_attention_heads
    if arch.is_moe:
        assert arch.norm_topk_prob == hf.norm_topk_prob
        assert arch.moe_aux_loss_coeff == hf.router_aux_loss_coef
        assert arch.shared_expert_intermediate_size == getattr(hf, "shared_expert_intermediate_size", None)
    if kind == "qwen2_moe":
        assert arch.qkv_bias == hf.qkv_bias


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"num_hidden_layers": 2.7}, r"num_hidden_layers=2\.7 .*must be an integer >= 1"),
        ({"num_hidden_layers": 0}, r"num_hidden_layers=0 .*must be an integer >= 1"),
        ({"hidden_size": "abc"}, r"hidden_size='abc' .*must be an integer"),
        ({"head_dim": "24"}, r"head_dim='24' .*must be an integer"),
        ({"num_attention_heads": True}, r"num_attention_heads=True .*must be an integer"),
        ({"num_key_value_heads": 3}, r"num_key_value_heads=3 .*must divide num_attention_heads \(4\)"),
        ({"rms_norm_eps": "abc"}, r"rms_norm_eps='abc' .*must be a number"),
        ({"rms_norm_eps": 0}, r"rms_norm_eps=0 .*must be a number > 0"),
        ({"rope_theta": "abc", "rope_parameters": None}, r"rope_theta='abc' .*must be a number"),
        ({"tie_word_embeddings": "yes"}, r"tie_word_embeddings='yes' .*must be true or false"),
        ({"attention_dropout": -0.1}, r"attention_dropout=-0\.1 .*must be a number >= 0"),
    ],
)
def test_bad_values_name_the_field(changes, message, checkpoints, tmp_path):
    bad = _edit(checkpoints("qwen3"), tmp_path / "bad", **changes)
    with pytest.raises(UnsupportedConfigError, match=rf"config\.json: {message}"):
        ts.megatron_args_from_hf(bad)


def test_cli_args_refuses_zero_layers(checkpoints, tmp_path):
    bad = _edit(checkpoints("qwen3"), tmp_path / "bad", num_hidden_layers=0)
    proc = subprocess.run(
        [sys.executable, "-m", "twinkle_specs.cli", "args", "--hf-model", str(bad)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "--num-layers" not in proc.stdout, proc.stdout
    assert "num_hidden_layers=0" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_missing_required_fields_are_listed_in_one_error(checkpoints, tmp_path):
    gone = ["hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size"]
    gone.append("max_position_embeddings")
    bad = _edit(checkpoints("qwen3"), tmp_path / "bad", **dict.fromkeys(gone))
    with pytest.raises(UnsupportedConfigError) as err:
        ts.megatron_args_from_hf(bad)
    msg = str(err.value)
    assert msg.startswith(f"{bad / 'config.json'}: missing field(s)") and "\n" not in msg, msg
    assert all(f"'{f}'" in msg for f in gone), msg
    moe = _edit(
        checkpoints("qwen3_moe"), tmp_path / "moe", num_local_experts=None, moe_intermediate_size=None
    )
    with pytest.raises(
        UnsupportedConfigError, match=r"missing field\(s\) \['num_experts', 'moe_intermediate_size'\]"
    ):
        ts.megatron_args_from_hf(moe)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_attention_bias_is_refused_by_name(kind, checkpoints, tmp_path):
    """transformers' Qwen3 and Qwen3-MoE bias q/k/v and o_proj when attention_bias is true; Megatron
    can bias QKV alone or every linear layer (MLP and experts too), so neither reproduces it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    bad = _edit(checkpoints(kind), tmp_path / "bad", attention_bias=True)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(bad))
    assert model.model.layers[0].self_attn.o_proj.bias is not None  # what would have to be reproduced
    with pytest.raises(UnsupportedConfigError, match=r"attention_bias=True .*o_proj"):
        ts.megatron_args_from_hf(bad)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "qwen3_yarn"])
def test_every_setting_names_its_config_field(kind, checkpoints):
    """The launcher's architecture check names, for each flag, the config.json field it comes from."""
    from twinkle_specs.config_mapping import architecture_settings

    settings = architecture_settings(checkpoints(kind))
    assert all(s.source in FIELD_POLICY for s in settings), [
        s for s in settings if s.source not in FIELD_POLICY
    ]
    flags = [f for s in settings for f in s.arch_flags]
    assert len(flags) == len(set(flags)), sorted(f for f in flags if flags.count(f) > 1)
    assert {"--rotary-interleaved", "--rotary-percent", "--apply-layernorm-1p", "--num-experts"} <= set(flags)
