"""YaRN rope scaling: config.json -> megatron-core mapping checked against transformers' own YaRN
computation, logits parity past original_max_position_embeddings, the attention factor, and the flag
path (Megatron-LM core_v0.19+ only). Parity of every YaRN kind in the tiny-config table also runs in
test_parity.test_logits_match_transformers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cpu_reference, free_port, megatron_training_root, megatron_training_version
from models import CONFIGS, YARN_SEQ, batch, hf_logits, qwen_config

import twinkle_specs as ts
from twinkle_specs.hf_config import UnsupportedConfigError, qwen_arch_from_hf

pytestmark = cpu_reference


TOL = 1e-4
# megatron.training of core_v0.19+: $MEGATRON_LM_019_ROOT (a checkout), else $MEGATRON_LM_ROOT or the installed
# megatron-core wheel when it is 0.19+ (the Python 3.12 CI leg).
MEGATRON_LM_019 = os.environ.get("MEGATRON_LM_019_ROOT") or megatron_training_root()
HAS_TRAINING_019 = bool(MEGATRON_LM_019) and megatron_training_version(MEGATRON_LM_019) >= (0, 19, 0)
WORKER = Path(__file__).parent / "yarn_megatron_lm_worker.py"
YARN_KINDS = sorted(k for k in CONFIGS if "yarn" in k)


def _installed_megatron_core():
    import megatron.core
    from packaging.version import Version

    return Version(megatron.core.__version__)


def _yarn_attrs(config) -> dict:
    return {name: getattr(config, name) for name in dir(config) if name.startswith("yarn_")}


def _megatron_logits(hf: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = ts.build_model(hf).eval()
    assert model.position_embedding_type == "yarn"
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)[
            ..., : CONFIGS["qwen3"]().vocab_size
        ]


@pytest.mark.parametrize(
    "rope,max_pos",
    [
        ({"factor": 4.0, "original_max_position_embeddings": 32}, 128),
        ({"factor": 4.0, "original_max_position_embeddings": 32, "attention_factor": 1.25}, 128),
        ({"factor": 3.0, "original_max_position_embeddings": 32, "attention_factor": 0.9}, 96),
        ({"factor": 8.0, "original_max_position_embeddings": 32, "mscale": 1.2, "mscale_all_dim": 0.8}, 256),
        # transformers ignores mscale unless mscale_all_dim is non-zero too (megatron-core would not).
        (
            {"factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.707, "mscale_all_dim": 0.0},
            256,
        ),
        ({"factor": None, "original_max_position_embeddings": 32}, 256),  # factor = 256 / 32
        ({"factor": 2.0, "original_max_position_embeddings": 64}, 256),
        ({"factor": 2.0, "beta_fast": 0, "beta_slow": None, "truncate": None}, 256),  # 0/None -> 32/1
        ({"factor": 2.5, "original_max_position_embeddings": 20, "beta_fast": 8, "beta_slow": 0.5}, 50),
        ({"factor": 4.0, "original_max_position_embeddings": 48, "truncate": False, "rope_theta": 1e6}, 192),
        ({"factor": 0.5, "original_max_position_embeddings": 32}, 16),  # factor <= 1: no attention factor
    ],
)
def test_yarn_mapping_matches_transformers_rope_math(rope, max_pos, tmp_path):
    """Megatron's YarnRotaryEmbedding (inverse frequencies) and its attention's concentration factor,
    built from our config attributes, against transformers' _compute_yarn_parameters on the same file."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
        _yarn_get_concentration_factor_from_config,
    )
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 10000.0} | rope
    qwen_config(
        "qwen3", architectures=["Qwen3ForCausalLM"], max_position_embeddings=max_pos, rope_parameters=rope
    ).save_pretrained(tmp_path)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](AutoConfig.from_pretrained(tmp_path), "cpu")

    arch = qwen_arch_from_hf(tmp_path)
    config = ts.transformer_config_from_hf(tmp_path)
    assert arch.yarn.attention_factor == pytest.approx(attention_factor, rel=1e-12, abs=0)
    assert _yarn_get_concentration_factor_from_config(config) == pytest.approx(
        attention_factor, rel=1e-12, abs=0
    )
    rotary = YarnRotaryEmbedding(  # as GPTModel builds it from the config
        kv_channels=config.kv_channels,
        rotary_base=arch.rotary_base,
        use_cpu_initialization=True,
        scaling_factor=config.yarn_rotary_scaling_factor,
        original_max_position_embeddings=config.yarn_original_max_position_embeddings,
        beta_fast=config.yarn_beta_fast,
        beta_slow=config.yarn_beta_slow,
        mscale=config.yarn_mscale,
        mscale_all_dim=config.yarn_mscale_all_dim,
        correction_range_round_to_int=config.yarn_correction_range_round_to_int,
    )
    emb, _ = rotary.get_emb(2)
    torch.testing.assert_close(emb[1, 0, 0, : config.kv_channels // 2], inv_freq, rtol=1e-6, atol=0)


def test_attention_factor_is_applied_by_megatron_attention(checkpoints, megatron_single, monkeypatch):
    """megatron-core's GPTModel drops the mscale that YarnRotaryEmbedding returns, but its SelfAttention
    scales RoPE's cos/sin by the concentration factor it derives from the config's yarn_* attributes
    (0.16 and 0.19 alike), which is transformers' attention_factor. Without that the logits are far off."""
    import megatron.core.transformer.attention as attention

    hf = checkpoints("qwen3_yarn")
    tokens = batch(s=YARN_SEQ)
    ref = hf_logits(hf, tokens)
    assert (_megatron_logits(hf, tokens) - ref).abs().max().item() <= TOL
    monkeypatch.setattr(attention, "_yarn_get_concentration_factor_from_config", lambda config: 1.0)
    assert (_megatron_logits(hf, tokens) - ref).abs().max().item() > 0.1  # measured 1.15


def test_legacy_rope_scaling_and_top_level_original_length(checkpoints, megatron_single, tmp_path):
    """A ``rope_scaling`` dict (legacy ``type`` key) replaces rope_parameters whole, rope_theta comes from
    the top level, and a top-level original_max_position_embeddings wins: all as transformers reads them."""
    hf = tmp_path / "legacy"
    shutil.copytree(checkpoints("qwen3_yarn"), hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    cfg["rope_scaling"] = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}
    cfg["rope_theta"] = 50000.0
    cfg["original_max_position_embeddings"] = 24
    (hf / "config.json").write_text(json.dumps(cfg))
    yarn = qwen_arch_from_hf(hf).yarn
    assert (yarn.field, yarn.factor, yarn.original_max_position_embeddings) == ("rope_scaling", 2.0, 24)
    assert qwen_arch_from_hf(hf).rotary_base == 50000.0
    tokens = batch(s=YARN_SEQ)
    assert (_megatron_logits(hf, tokens) - hf_logits(hf, tokens)).abs().max().item() <= TOL


def test_flags_need_megatron_lm_019(checkpoints):
    hf = checkpoints("qwen3_yarn")
    with pytest.raises(
        UnsupportedConfigError, match=r"rope_parameters\.rope_type='yarn' needs Megatron-LM core_v0\.19\+"
    ):
        ts.megatron_args_from_hf(hf, megatron_version="0.16.1")
    flags = ts.megatron_args_from_hf(hf, megatron_version="0.19.0")
    i = flags.index("--position-embedding-type")
    assert flags[i : i + 4] == ["--position-embedding-type", "yarn", "--rotary-base", "10000"]
    assert flags[flags.index("--rotary-scaling-factor") + 1] == "4.0"
    assert flags[flags.index("--yarn-original-max-position-embeddings") + 1] == "32"
    assert "--no-rope-fusion" in flags and "--yarn-correction-range-round-to-int" in flags
    assert "--no-yarn-correction-range-round-to-int" in ts.megatron_args_from_hf(
        checkpoints("qwen3_yarn_mscale"), megatron_version="0.19.0"
    )


@pytest.mark.skipif(_installed_megatron_core().release >= (0, 19), reason="megatron-core here is 0.19+")
def test_launcher_refuses_yarn_before_megatron_019(checkpoints, capsys):
    """The launcher turns config.json into Megatron-LM flags, which exist only from core_v0.19 on: a
    configuration error, one line, exit 2."""
    import re

    from twinkle_specs import launch

    hf = str(checkpoints("qwen3_yarn"))
    with pytest.raises(SystemExit) as exit_:
        launch.main(["pretrain_gpt.py", "--hf-model", hf, "--micro-batch-size", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(r"rope_type='yarn' needs Megatron-LM core_v0\.19\+.*here is 0\.1[0-8]", err), err
    with pytest.raises(UnsupportedConfigError, match="core_v0.19"):
        ts.megatron_args_from_hf(hf)  # what `twinkle-specs args` prints
    assert _yarn_attrs(ts.transformer_config_from_hf(hf))  # our own GPTModel construction still has it


@pytest.mark.skipif(
    _installed_megatron_core().release < (0, 19), reason="megatron-core here is older than 0.19"
)
def test_flags_by_default_with_megatron_019(checkpoints):
    assert "yarn" in ts.megatron_args_from_hf(checkpoints("qwen3_yarn"))


def test_rope_fusion_is_refused_with_yarn(checkpoints):
    with pytest.raises(ValueError, match="apply_rope_fusion"):
        ts.transformer_config_from_hf(checkpoints("qwen3_yarn"), apply_rope_fusion=True)


@pytest.mark.skipif(
    not HAS_TRAINING_019,
    reason="needs megatron.training of core_v0.19+: megatron-core 0.19's wheel (the Python 3.12 CI leg) or a "
    "checkout in $MEGATRON_LM_019_ROOT",
)
@pytest.mark.parametrize("kind", ["qwen2_yarn", "qwen3_yarn_mscale"])
def test_flags_through_megatron_lm_019_match_transformers(kind, checkpoints, tmp_path):
    """The launcher path on core_v0.19: our flags through Megatron-LM's own parse_args, validate_args and
    core_transformer_config_from_args (which copies them to config.yarn_*), GPTModel with the spec and
    the args' position embedding, on CPU: the same yarn_* as build_model's config, and the logits."""
    hf = checkpoints(kind)
    flags = ts.megatron_args_from_hf(hf, megatron_version="0.19.0")
    cpu = [
        "--micro-batch-size", "1", "--seq-length", str(YARN_SEQ), "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "256", "--transformer-impl", "local", "--use-cpu-initialization",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
        "--no-bias-dropout-fusion", "--no-persist-layer-norm",
    ]  # fmt: skip
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["MASTER_PORT"] = str(free_port())  # not the one this process's own group may hold
    env.pop("PYTHONPATH", None)  # the worker puts the checkout first itself
    proc = subprocess.run(
        [sys.executable, str(WORKER), MEGATRON_LM_019, str(hf), str(tmp_path), str(YARN_SEQ), *flags, *cpu],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    info = json.loads((tmp_path / "config.json").read_text())
    assert (
        info["megatron_core_file"].startswith(MEGATRON_LM_019)
        and info["rotary_pos_emb"] == "YarnRotaryEmbedding"
    )
    assert not info["apply_rope_fusion"]
    ours = _yarn_attrs(ts.transformer_config_from_hf(hf))
    assert {k: info[k] for k in ours} == ours
    run = torch.load(tmp_path / "logits.pt")
    assert torch.equal(run["tokens"], batch(s=YARN_SEQ))
    ref = hf_logits(hf, run["tokens"])
    assert (run["logits"][..., : ref.shape[-1]] - ref).abs().max().item() <= TOL
