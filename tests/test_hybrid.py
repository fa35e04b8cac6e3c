"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (hybrid Gated DeltaNet + gated full attention) on the portable
path: config mapping, fp32 logits against transformers at every position, strict loading with the
vision tower left alone by rule, and HF -> Megatron -> HF bit-exact, at TP=1 and on gloo at TP/PP/EP=2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import cpu_reference
from hybrid_models import LAYER_TYPES, VOCAB, hybrid_batch, hybrid_hf_logits, make_hybrid_checkpoint
from safetensors.torch import load_file

import twinkle_specs as ts
from twinkle_specs.checkpoint import CheckpointError
from twinkle_specs.hf_config import UnsupportedConfigError

TOL = 1e-4  # max |Δ| of fp32 logits; measured 6.7e-6 .. 8.3e-6 at TP=1, TP=2, PP=2 and EP=2 (torch 2.13 CPU);
# TP=2 with sequence parallelism gives TP=2's logits bit for bit
WORKER = Path(__file__).parent / "dist_worker.py"
KINDS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl")


@pytest.fixture(scope="session")
def hybrid(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("hf-hybrid"), {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_hybrid_checkpoint(kind, root / kind)
        return made[kind]

    return get


def _flag(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def _load_all(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out |= load_file(f)
    return out


def _edit(src: Path, dst: Path, text: bool = False, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (cfg["text_config"] if text else cfg).update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_flags(kind, hybrid):
    flags = ts.megatron_args_from_hf(hybrid(kind))
    pattern = "[" + ",".join(str(int(t == "linear_attention")) for t in LAYER_TYPES) + "]"
    assert _flag(flags, "--experimental-attention-variant") == "gated_delta_net"
    assert _flag(flags, "--linear-attention-freq") == pattern == "[1,0,0,1]"
    assert _flag(flags, "--linear-num-key-heads") == "2" and _flag(flags, "--linear-num-value-heads") == "4"
    assert _flag(flags, "--linear-key-head-dim") == "8" and _flag(flags, "--linear-value-head-dim") == "12"
    assert _flag(flags, "--linear-conv-kernel-dim") == "3" and _flag(flags, "--rotary-percent") == "0.25"
    assert {"--apply-layernorm-1p", "--attention-output-gate", "--qk-layernorm"} <= set(flags)
    assert ("--num-experts" in flags) == (kind in ("qwen3_next", "qwen3_5_moe"))
    assert ("--moe-shared-expert-gate" in flags) == (kind in ("qwen3_next", "qwen3_5_moe"))
    cfg = ts.transformer_config_from_hf(hybrid(kind))
    assert cfg.linear_attention_freq == [1, 0, 0, 1] and cfg.attention_output_gate
    assert cfg.layernorm_zero_centered_gamma and cfg.experimental_attention_variant == "gated_delta_net"


@pytest.mark.parametrize(
    "kind,text,changes,field",
    [
        ("qwen3_5", False, {"some_new_field": 1}, "some_new_field"),
        ("qwen3_5_vl", True, {"some_new_field": 1}, "some_new_field"),
        ("qwen3_5_vl", False, {"some_new_field": 1}, "some_new_field"),
        ("qwen3_next", False, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ("qwen3_next", False, {"rope_parameters": {"rope_type": "default", "factor": 4.0}}, "factor"),
        ("qwen3_5", False, {"hidden_act": "gelu"}, "hidden_act"),
        ("qwen3_5_moe", False, {"attention_bias": True}, "attention_bias"),
        ("qwen3_next", False, {"layer_types": ["full_attention"] * 3}, "layer_types"),
        ("qwen3_next", False, {"layer_types": ["sliding_attention"] * 4}, "layer_types"),
        ("qwen3_next", False, {"mlp_only_layers": [1]}, "mlp_only_layers"),
        ("qwen3_5", False, {"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ("qwen3_5", False, {"model_type": "qwen3_next"}, "model_type"),
        ("qwen3_5_vl", True, {"attn_output_gate": False}, "attn_output_gate"),
        ("qwen3_5_moe", False, {"architectures": ["Qwen4ExpForCausalLM"]}, "hyper-connections"),
        ("qwen3_5_moe", False, {"output_gate_type": "sigmoid"}, "output_gate_type"),
    ],
)
def test_hybrid_config_errors_name_the_field(kind, text, changes, field, hybrid, tmp_path):
    bad = _edit(hybrid(kind), tmp_path / "bad", text=text, **changes)
    with pytest.raises(UnsupportedConfigError, match=field):
        ts.megatron_args_from_hf(bad)


def test_qwen3_moe_attention_bias_is_refused(checkpoints, tmp_path):
    """Qwen3-MoE's attention_bias puts a bias on o_proj too, which Megatron cannot express."""
    src = checkpoints("qwen3_moe")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text()) | {"attention_bias": True}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedConfigError, match="attention_bias"):
        ts.megatron_args_from_hf(bad)


def test_hybrid_tp_must_divide_linear_heads(hybrid):
    with pytest.raises(
        ValueError, match="linear_num_key_heads=2 is not divisible by tensor_model_parallel_size=4: "
    ):
        ts.transformer_config_from_hf(
            hybrid("qwen3_5"), tensor_model_parallel_size=4, num_attention_heads=8, num_query_groups=4
        )


# fp32, the layer at CP 2 on gloo against CP 1: output and input gradient are computed per token from the
# same whole-sequence mixing; parameter gradients sum the two ranks' parts in another order.
CP_RTOL = 1e-5


def test_gated_deltanet_context_parallel_matches_the_whole_sequence(hybrid, tmp_path):
    """Two ranks at context parallel 2, each with its two of the sequence's four chunks (megatron's load
    balancing): the layer's output and input gradient equal the whole-sequence layer's on those rows, and the
    parameter gradients summed over the CP group equal its gradients (each rank holds half the heads)."""
    from conftest import run_dist

    out = tmp_path / "cp.json"
    worker = Path(__file__).with_name("gdn_cp_worker.py")
    run_dist(2, worker, str(hybrid("qwen3_5")), str(out), cpu_only=True, timeout=240)
    result = json.loads(out.read_text())
    for diffs in result["per_rank"]:
        assert set(diffs) == {"output", "input grad", *result["params"]}, diffs
        assert {"conv1d.weight", "A_log", "dt_bias", "in_proj.weight"} <= set(diffs), diffs
        assert max(diffs.values()) <= CP_RTOL, diffs


def test_context_parallel_layouts_gated_deltanet_cannot_run_are_refused(hybrid, checkpoints):
    """Packed rows (--sft), heads that CP x TP does not divide, megatron-core 0.16: refused by the launcher
    before any rank builds, and by the layer (runs without the launcher)."""
    import argparse

    import megatron.core
    from packaging.version import Version

    from twinkle_specs.gdn import PortableGatedDeltaNet
    from twinkle_specs.launch import LaunchError, check_context_parallel

    config = ts.transformer_config_from_hf(hybrid("qwen3_5"))  # 2 key heads, 4 value heads
    # set after construction: megatron-core 0.16's TransformerConfig asserts it away, 0.19's allows it
    config.context_parallel_size = 4
    with pytest.raises(ValueError, match=r"^--context-parallel-size 4 .* divide the key heads \(2,"):
        PortableGatedDeltaNet(config, submodules=None, layer_number=1)
    cases = [
        (dict(context_parallel_size=2, sft=True), r"with packed sequences \(--sft\)"),
        (dict(context_parallel_size=2, tensor_model_parallel_size=2), r"must divide the key heads"),
    ]
    if Version(megatron.core.__version__) < Version("0.19"):
        cases = [(dict(context_parallel_size=2), r"needs megatron-core 0\.19\+")]
    for given, message in cases:
        with pytest.raises(LaunchError, match=r"config\.json: --context-parallel-size .*" + message):
            check_context_parallel(argparse.Namespace(**given), hybrid("qwen3_5_moe"))
    if Version(megatron.core.__version__) >= Version("0.19"):
        check_context_parallel(argparse.Namespace(context_parallel_size=2), hybrid("qwen3_5"))
    check_context_parallel(argparse.Namespace(context_parallel_size=2), checkpoints("qwen3"))  # dense


def test_checkpoint_keys_are_those_a_te_model_loads(hybrid, megatron_single):
    """The portable model's checkpoint keys are a Transformer Engine model's: a Gated DeltaNet layer's input
    norm is in_proj's fused norm there, a full-attention layer's linear_qkv's. A `convert` output then loads
    into pretrain_gpt.py's TE model, and a TE-trained checkpoint exports through the portable model."""
    model = ts.build_model(hybrid("qwen3_5"), load_weights=False)
    keys = {t.key for t in model.sharded_state_dict().values() if hasattr(t, "key")}  # checkpoint keys
    for i, kind in enumerate(LAYER_TYPES):
        fused = "in_proj" if kind == "linear_attention" else "linear_qkv"
        layer = {k.split(".", 3)[3] for k in keys if k.startswith(f"decoder.layers.{i}.")}
        assert f"self_attention.{fused}.layer_norm_weight" in layer, sorted(layer)
        assert not any(k.startswith("input_layernorm") for k in layer), sorted(layer)
        if kind == "linear_attention":
            assert not any(k.startswith("self_attention.linear_qkv") for k in layer), sorted(layer)


def test_layer_types_default_from_full_attention_interval(hybrid, tmp_path):
    """Without layer_types, transformers' rule: one full-attention layer every full_attention_interval."""
    src = hybrid("qwen3_5_vl")
    edited = tmp_path / "edited"
    shutil.copytree(src, edited)
    cfg = json.loads((edited / "config.json").read_text())
    del cfg["text_config"]["layer_types"]
    cfg["text_config"]["full_attention_interval"] = 2
    (edited / "config.json").write_text(json.dumps(cfg))
    assert _flag(ts.megatron_args_from_hf(edited), "--linear-attention-freq") == "[1,0,1,0]"


def test_mtp_head_is_left_alone_and_written_back(hybrid, megatron_single, tmp_path):
    """A checkpoint's MTP head (mtp.*, unused by transformers too) is left alone by its rule, shown in the
    load report, and export writes it back byte-identical."""
    from safetensors.torch import save_file

    src = tmp_path / "with-mtp"
    shutil.copytree(hybrid("qwen3_next"), src)
    mtp = {"mtp.fc.weight": torch.randn(48, 96).to(torch.bfloat16), "mtp.norm.weight": torch.ones(48)}
    save_file(
        load_file(src / "model.safetensors") | mtp, src / "model.safetensors", metadata={"format": "pt"}
    )
    model = ts.build_model(src, load_weights=False)
    report = ts.load_hf_weights(model, src)
    assert dict(report.left_alone) == {"mtp.": 2} and "mtp.*: 2 tensors" in str(report)
    ts.save_hf_weights(model, tmp_path / "export")
    exported = _load_all(tmp_path / "export")
    for name, t in mtp.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name


def test_every_saved_hybrid_field_has_a_policy(hybrid):
    from twinkle_specs.hybrid_config import HYBRID_FIELD_POLICY, MULTIMODAL_FIELD_POLICY

    for kind in KINDS:
        cfg = json.loads((hybrid(kind) / "config.json").read_text())
        if "text_config" in cfg:
            assert set(cfg) <= set(MULTIMODAL_FIELD_POLICY), set(cfg) - set(MULTIMODAL_FIELD_POLICY)
            cfg = cfg["text_config"]
        assert set(cfg) <= set(HYBRID_FIELD_POLICY), set(cfg) - set(HYBRID_FIELD_POLICY)


@cpu_reference
@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_logits_match_transformers(kind, hybrid, megatron_single, caplog):
    hf = hybrid(kind)
    model = ts.build_model(hf, load_weights=False).eval()
    report = ts.load_hf_weights(model, hf)
    if kind == "qwen3_5_vl":  # the vision tower is left alone by its rule, and the report says so
        assert set(report.left_alone) == {"model.visual."} and "model.visual.*: 21 tensors" in str(report)
    else:
        assert not report.left_alone
    tokens = hybrid_batch()
    with torch.no_grad():
        ours = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)[..., :VOCAB]
    ref = hybrid_hf_logits(hf, tokens)
    assert ref.abs().mean() > 0.1  # not degenerate
    per_position = (ours - ref).abs().amax(dim=(0, 2))
    assert per_position.max().item() <= TOL, per_position


@cpu_reference
def test_hybrid_layers_are_chosen_by_layer_types(hybrid, megatron_single):
    from twinkle_specs.gdn import PortableGatedDeltaNet

    model = ts.build_model(hybrid("qwen3_next"), load_weights=False)
    kinds = [
        "linear_attention" if isinstance(layer.self_attention, PortableGatedDeltaNet) else "full_attention"
        for layer in model.decoder.layers
    ]
    assert kinds == LAYER_TYPES


def test_unknown_tensor_is_still_refused(hybrid, megatron_single, tmp_path):
    """Only the named rules leave tensors alone: anything else in the checkpoint is still an error."""
    from safetensors.torch import save_file

    src = hybrid("qwen3_5")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    tensors = load_file(bad / "model.safetensors") | {"model.visual.patch_embed.proj.weight": torch.zeros(2)}
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})  # text-only: no vision rule
    model = ts.build_model(src, load_weights=False)
    with pytest.raises(CheckpointError, match="model.visual.patch_embed"):
        ts.load_hf_weights(model, bad)


@cpu_reference
@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_vl"])
def test_hybrid_round_trip_is_bit_exact(kind, hybrid, megatron_single, tmp_path):
    """HF -> Megatron -> HF: every tensor bit-exact, the vision tower byte-identical, and transformers
    loads the export as the same model."""
    hf = hybrid(kind)
    model = ts.build_model(hf)
    ts.save_hf_weights(model, tmp_path / "export")
    src, exported = _load_all(hf), _load_all(tmp_path / "export")
    assert sorted(src) == sorted(exported)
    for name, t in src.items():
        assert torch.equal(t, exported[name]), name
    tokens = hybrid_batch(s=16)
    assert torch.equal(hybrid_hf_logits(hf, tokens), hybrid_hf_logits(tmp_path / "export", tokens))


LAYOUTS = [
    ("qwen3_5", ["--tp", "2"]),  # GDN heads and the gated QKV split over TP
    ("qwen3_5", ["--tp", "2", "--sp"]),  # and the tokens between the layers (sequence parallel)
    ("qwen3_next", ["--tp", "2"]),  # fused in_proj_qkvz / in_proj_ba regrouped per rank
    ("qwen3_next", ["--pp", "2"]),  # linear and full layers on both stages
    ("qwen3_5_moe", ["--ep", "2"]),  # routed experts over ranks, gated shared expert
    ("qwen3_5_vl", ["--pp", "2"]),  # multimodal checkpoint: language model prefix, vision left alone
]
LAYOUT_IDS = [f"{kind}-layout{i}" for i, (kind, _) in enumerate(LAYOUTS)]


@pytest.fixture(scope="module")
def layouts(hybrid, tmp_path_factory, request):
    """Every layout of test_hybrid_parallel_layouts, run by dist_worker.py in one torchrun launch (see
    tests/dist_jobs.py); each test asserts on its own layout's outputs."""
    from dist_jobs import DistJobs

    jobs = DistJobs(WORKER, tmp_path_factory.mktemp("hybrid-layouts"), request)
    for name, (kind, layout) in zip(LAYOUT_IDS, LAYOUTS, strict=True):
        jobs.add(name, 2, _worker_args(hybrid, kind, layout), test=f"test_hybrid_parallel_layouts[{name}]")
    return jobs


def _worker_args(hybrid, kind, layout):
    def prepare(out: Path) -> list[str]:
        torch.save(hybrid_batch(), out / "tokens.pt")
        return ["--hf", str(hybrid(kind)), "--out", str(out), "--tokens", str(out / "tokens.pt"), *layout]

    return prepare


@pytest.mark.parametrize("kind,layout", LAYOUTS, ids=LAYOUT_IDS)
def test_hybrid_parallel_layouts(kind, layout, hybrid, layouts, request):
    if torch.cuda.is_available():
        pytest.skip("CPU reference (gloo); the GPU path of the hybrid models is not verified yet")
    hf = hybrid(kind)
    out = layouts.out(request.node.callspec.id)
    tokens = torch.load(out / "tokens.pt")  # what the worker ran
    ours = torch.load(out / "logits.pt")[..., :VOCAB]
    assert (ours - hybrid_hf_logits(hf, tokens)).abs().max().item() <= TOL
    src, exported = _load_all(hf), _load_all(out / "export")
    assert sorted(src) == sorted(exported)
    for name, t in src.items():
        assert torch.equal(t, exported[name]), name
    for r in range(2):
        assert json.loads((out / f"dist-ckpt-{r}.json").read_text()) == {"mismatched": []}


def test_hybrid_convert_and_export(hybrid, tmp_path, megatron_single):
    """``convert`` writes a Megatron-LM torch_dist checkpoint of the multimodal Qwen3.5 at PP=2; loaded at
    PP=1 it gives transformers' logits, and ``export`` writes the source checkpoint back bit-exact (the
    vision tower byte-identical)."""
    from megatron.core import dist_checkpointing

    from twinkle_specs.megatron_checkpoint import RELEASE, Layout, convert, export

    hf = hybrid("qwen3_5_vl")
    convert(hf, tmp_path / "mcore", Layout(pp=2))
    model = ts.build_model(hf, load_weights=False).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(tmp_path / "mcore" / RELEASE))
    model.load_state_dict(loaded["model"], strict=True)
    tokens = hybrid_batch()
    with torch.no_grad():
        ours = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)[..., :VOCAB]
    assert (ours - hybrid_hf_logits(hf, tokens)).abs().max().item() <= TOL
    assert export(tmp_path / "mcore", hf, tmp_path / "hf") == "full"
    src, exported = _load_all(hf), _load_all(tmp_path / "hf")
    assert sorted(src) == sorted(exported)
    assert all(torch.equal(t, exported[n]) for n, t in src.items())


# Fields transformers' hybrid config classes default: left out, each must read as AutoConfig reads it.
HYBRID_OPTIONAL = (  # num_key_value_heads stays: the class defaults (2, 4) need not divide the 6 heads
    "head_dim",
    "rms_norm_eps",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "initializer_range",
    "attention_dropout",
    "shared_expert_intermediate_size",
    "router_aux_loss_coef",
    "norm_topk_prob",
)


def _strip(src: Path, dst: Path, fields, text: bool) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    part = cfg["text_config"] if text else cfg
    for f in fields:
        part.pop(f, None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_config_absent_fields_are_read_as_transformers_reads_them(kind, hybrid, tmp_path):
    """With the optional fields left out (in text_config for the multimodal model), every architecture
    fact equals what transformers' own config class resolves (head_dim 256, 16/32 linear heads, ...)."""
    from transformers import AutoConfig

    from twinkle_specs.hf_config import qwen_arch_from_hf

    stripped = _strip(hybrid(kind), tmp_path / "stripped", HYBRID_OPTIONAL, text=kind == "qwen3_5_vl")
    arch = qwen_arch_from_hf(stripped)
    hf = AutoConfig.from_pretrained(stripped)
    hf = hf.text_config if kind == "qwen3_5_vl" else hf
    h = arch.hybrid
    assert arch.kv_channels == hf.head_dim == 256 and arch.num_query_groups == hf.num_key_value_heads
    assert (h.num_key_heads, h.num_value_heads) == (hf.linear_num_key_heads, hf.linear_num_value_heads)
    assert (h.key_head_dim, h.value_head_dim) == (hf.linear_key_head_dim, hf.linear_value_head_dim)
    assert h.conv_kernel == hf.linear_conv_kernel_dim and arch.norm_epsilon == hf.rms_norm_eps
    assert arch.init_method_std == hf.initializer_range and arch.attention_dropout == hf.attention_dropout
    assert h.rotary_percent == hf.rope_parameters["partial_rotary_factor"]
    if arch.is_moe:
        assert arch.shared_expert_intermediate_size == hf.shared_expert_intermediate_size
        assert arch.moe_aux_loss_coeff == hf.router_aux_loss_coef
        assert arch.norm_topk_prob == getattr(hf, "norm_topk_prob", True)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"num_hidden_layers": 2.7}, r"num_hidden_layers=2\.7 .*must be an integer >= 1"),
        ({"num_hidden_layers": 0}, r"num_hidden_layers=0 .*must be an integer >= 1"),
        ({"num_hidden_layers": "abc"}, r"num_hidden_layers='abc' .*must be an integer"),
        ({"num_hidden_layers": True}, r"num_hidden_layers=True .*must be an integer"),
        ({"hidden_size": 48.5}, r"hidden_size=48\.5 .*must be an integer"),
        ({"head_dim": "16"}, r"head_dim='16' .*must be an integer"),
        ({"vocab_size": 0}, r"vocab_size=0 .*must be an integer >= 1"),
        ({"linear_num_key_heads": 0}, r"linear_num_key_heads=0 .*must be an integer >= 1"),
        ({"linear_conv_kernel_dim": 3.5}, r"linear_conv_kernel_dim=3\.5 .*must be an integer"),
        ({"num_key_value_heads": 4}, r"num_key_value_heads=4 .*must divide num_attention_heads \(6\)"),
        ({"rms_norm_eps": "abc"}, r"rms_norm_eps='abc' .*must be a number"),
        ({"rms_norm_eps": 0}, r"rms_norm_eps=0 .*must be a number > 0"),
        ({"attention_dropout": -0.1}, r"attention_dropout=-0\.1 .*must be a number >= 0"),
        ({"rope_parameters": {"rope_theta": "abc"}}, r"rope_parameters\.rope_theta='abc' .*must be a number"),
        ({"tie_word_embeddings": "yes"}, r"tie_word_embeddings='yes' .*must be true or false"),
        ({"attention_bias": "no"}, r"attention_bias='no' .*must be true or false"),
        ({"layer_types": None, "full_attention_interval": 0}, r"full_attention_interval=0 .*>= 1"),
        ({"num_experts": 2.5}, r"num_experts=2\.5 .*must be an integer"),
        ({"num_experts_per_tok": "2"}, r"num_experts_per_tok='2' .*must be an integer"),
        ({"norm_topk_prob": 1}, r"norm_topk_prob=1 .*must be true or false"),
    ],
)
@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_config_bad_values_name_the_field(kind, changes, message, hybrid, tmp_path):
    moe_only = {"num_experts", "num_experts_per_tok", "norm_topk_prob"}
    if moe_only & changes.keys() and kind not in ("qwen3_next", "qwen3_5_moe"):
        pytest.skip("a dense model has no experts")
    if "norm_topk_prob" in changes and kind != "qwen3_next":
        pytest.skip("only Qwen3-Next reads norm_topk_prob")
    bad = _edit(hybrid(kind), tmp_path / "bad", text=kind == "qwen3_5_vl", **changes)
    where = r"config\.json text_config" if kind == "qwen3_5_vl" else r"config\.json"
    with pytest.raises(UnsupportedConfigError, match=rf"{where}: {message}") as err:
        ts.megatron_args_from_hf(bad)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "kind,gone",
    [
        ("qwen3_5", ["hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads"]),
        ("qwen3_5_vl", ["vocab_size", "max_position_embeddings", "intermediate_size"]),
        ("qwen3_5_moe", ["hidden_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size"]),
        ("qwen3_next", ["num_hidden_layers", "vocab_size", "num_experts", "moe_intermediate_size"]),
    ],
)
def test_hybrid_config_missing_required_fields_are_listed_in_one_error(kind, gone, hybrid, tmp_path):
    """Shape fields absent or null: one error naming the file and every missing field (transformers
    would fill them in from its class, the sizes of an 80B model)."""
    text = kind == "qwen3_5_vl"
    bad = _strip(hybrid(kind), tmp_path / "bad", gone[::2], text=text)
    cfg = json.loads((bad / "config.json").read_text())
    (cfg["text_config"] if text else cfg).update(dict.fromkeys(gone[1::2]))  # null counts as missing
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedConfigError) as err:
        ts.megatron_args_from_hf(bad)
    where = f"{bad / 'config.json'}{' text_config' if text else ''}"
    msg = str(err.value)
    assert msg.startswith(f"{where}: missing field(s) [") and "\n" not in msg, msg
    assert sorted(msg.split("[")[1].split("]")[0].replace("'", "").split(", ")) == sorted(gone), msg


def test_hybrid_config_moe_needs_no_dense_mlp_size(hybrid, tmp_path):
    """Qwen3.5-MoE has no dense MLP: intermediate_size is not required there; Qwen3-Next with
    num_experts 0 is dense and needs it."""
    moe = _strip(hybrid("qwen3_5_moe"), tmp_path / "moe", ["intermediate_size"], text=False)
    assert ts.megatron_args_from_hf(moe)
    dense = _strip(hybrid("qwen3_next"), tmp_path / "dense", ["intermediate_size"], text=False)
    cfg = json.loads((dense / "config.json").read_text()) | {"num_experts": 0}
    (dense / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedConfigError, match=r"missing field\(s\) \['intermediate_size'\]"):
        ts.megatron_args_from_hf(dense)


@pytest.mark.parametrize(
    "hopper,triton,tilelang,fla_trains_alone",
    [
        (True, "3.6.0", False, False),  # torch 2.11's Triton on an H100: fla refuses its backward
        (True, "3.6.0", True, True),  # fla takes that kernel to its tilelang backend
        (True, "3.7.1", False, True),
        (False, "3.6.0", False, True),  # not Hopper
    ],
)
def test_fla_rule_trains_with_the_torch_dqkwg_where_fla_refuses_its_own(
    hopper, triton, tilelang, fla_trains_alone, monkeypatch, caplog
):
    """fla 0.6 raises in one kernel of the Gated DeltaNet backward (the gated chunk_bwd_dqkwg) on Hopper
    with Triton in [3.4, 3.7.1) (seen on the H100 at the first training step): a training call then gives
    fla twinkle_specs.gdn_dqkwg's torch one and keeps fla's rule, with one warning that says why and what
    to install; forward-only calls and every other setup use fla as it is."""
    import importlib.machinery
    import importlib.util
    import sys
    import types

    from twinkle_specs import gdn

    def rule():  # stands in for fla's chunk_gated_delta_rule
        raise AssertionError("not called here")

    version = tuple(int(x) for x in triton.split("."))
    fla_utils = types.SimpleNamespace(
        IS_NVIDIA_HOPPER=hopper,
        TRITON_ABOVE_3_4_0=version >= (3, 4, 0),
        TRITON_ABOVE_3_7_1=version >= (3, 7, 1),
    )
    fla = types.ModuleType("fla")
    fla.__spec__ = importlib.machinery.ModuleSpec("fla", None)
    modules = {
        "fla": fla,
        "fla.utils": fla_utils,
        "fla.ops": types.ModuleType("fla.ops"),
        "fla.ops.gated_delta_rule": types.SimpleNamespace(chunk_gated_delta_rule=rule),
        "triton": types.SimpleNamespace(__version__=triton),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (object() if tilelang else None) if name == "tilelang" else real_find_spec(name, *a),
    )
    from twinkle_specs import gdn_dqkwg

    enabled = []
    monkeypatch.setattr(gdn_dqkwg, "enable", lambda: enabled.append(1))
    gdn.fla_backward_refused.cache_clear()
    gdn._warn_once.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="twinkle_specs.gdn"):
            assert gdn._fla_rule(needs_grad=False) is rule
            assert not enabled
            assert gdn._fla_rule(needs_grad=True) is rule
            gdn._fla_rule(needs_grad=True)
            kernel = gdn.training_rule(on_cuda=True)  # what the benchmark records
    finally:
        gdn.fla_backward_refused.cache_clear()
        gdn._warn_once.cache_clear()
    warnings = [r.getMessage() for r in caplog.records if r.name == "twinkle_specs.gdn"]
    if fla_trains_alone:
        assert kernel == "fla chunk_gated_delta_rule" and not warnings and not enabled, (kernel, warnings)
    else:
        assert kernel.startswith(
            "fla chunk_gated_delta_rule, chunk_bwd_dqkwg in torch (twinkle_specs.gdn_dqkwg"
        ), kernel
        assert len(enabled) == 2, enabled  # gdn_dqkwg.enable registers once itself (functools.cache)
        assert len(warnings) == 1, warnings
        assert f"Triton {triton}" in warnings[0] and "tilelang" in warnings[0], warnings
