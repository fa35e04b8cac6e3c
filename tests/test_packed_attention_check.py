"""The refusal of Transformer Engine's packed attention where its cuDNN trains it wrong (heads above 128 on Hopper,
cuDNN older than 9.18; ``twinkle_specs.packed_attention_check``): when it applies, what it says, the launcher's
check and the attention module's. The GPU side (the bug itself, and cuDNN 9.19 right) is
``tests/test_packed_attention_check_gpu.py``."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from twinkle_specs import packed_attention_check as check
from twinkle_specs import spec
from twinkle_specs.config_mapping import transformer_config_from_hf

HOPPER, BLACKWELL = (9, 0), (10, 0)
WHEEL = ("/site/nvidia/cudnn/lib", 91900)


def test_cudnn_versions_read_as_cudnn_numbers_them():
    assert check.cudnn_name(91400) == "9.14.0"
    assert check.cudnn_name(91800) == "9.18.0"
    assert check.cudnn_name(8907) == "8.9.7"


def test_refused_only_above_128_on_hopper_before_cudnn_9_18():
    message = check.refusal(256, HOPPER, 91400, WHEEL)
    assert "head dim 256 on Hopper" in message
    assert "cuDNN 9.14.0, the one TE loaded here" in message
    assert "fixed in cuDNN 9.18.0" in message
    assert (
        "has 9.19.0: export CUDNN_HOME=/site/nvidia/cudnn/lib LD_LIBRARY_PATH=/site/nvidia/cudnn/lib:"
        in message
    )
    assert "--flash-attn-4" in message and "no --sft" in message
    assert "head dim 192" in check.refusal(192, HOPPER, 91700)
    for head_dim, capability, cudnn in [(128, HOPPER, 91400), (256, BLACKWELL, 91400), (256, HOPPER, 91800)]:
        assert check.refusal(head_dim, capability, cudnn, WHEEL) is None, (head_dim, capability, cudnn)
    assert check.refusal(256, HOPPER, None, WHEEL) is None  # TE cannot say: no refusal on a guess


def test_the_remedy_names_the_wheel_only_where_it_is_newer():
    older = check.refusal(256, HOPPER, 91400, ("/w", 91600))
    assert "CUDNN_HOME=/w" not in older
    assert "install cuDNN 9.18 or newer and point CUDNN_HOME and LD_LIBRARY_PATH at it" in older
    assert "install cuDNN 9.18" in check.refusal(256, HOPPER, 91400, None)


def _args(**overrides):
    fields = dict(
        sft=True,
        flash_attn_4=False,
        transformer_impl="transformer_engine",
        kv_channels=256,
        hidden_size=1024,
        num_attention_heads=8,
    )
    return SimpleNamespace(**{**fields, **overrides})


def test_the_launcher_refuses_sft_on_te_attention_it_would_train_wrong(monkeypatch):
    asked = []
    monkeypatch.setattr(
        check, "current_refusal", lambda head_dim: asked.append(head_dim) or "the cuDNN story"
    )
    assert check.launch_refusal(_args()) == "--sft: the cuDNN story"
    assert check.launch_refusal(_args(kv_channels=None)) == "--sft: the cuDNN story"
    assert asked == [256, 128]  # --kv-channels, else hidden size / heads
    for other in ({"sft": False}, {"flash_attn_4": True}, {"transformer_impl": "local"}):
        assert check.launch_refusal(_args(**other)) is None, other
    monkeypatch.setattr(check, "current_refusal", lambda head_dim: None)
    assert check.launch_refusal(_args()) is None


class _TEAttention(torch.nn.Module):
    """megatron's TEDotProductAttention's constructor and forward, recording what reaches it."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **_):
        super().__init__()
        self.calls: list[object] = []

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):  # fmt: skip
        self.calls.append(packed_seq_params)
        return query.flatten(-2)


@pytest.fixture
def checked(monkeypatch):
    monkeypatch.setattr(check, "_te_dot_product_attention", lambda: _TEAttention)
    check.checked_te_attention_class.cache_clear()
    yield check.checked_te_attention_class()
    check.checked_te_attention_class.cache_clear()


@pytest.mark.parametrize("problem", ["the cuDNN story", None])
def test_the_attention_module_refuses_packed_calls_its_cudnn_would_get_wrong(checked, monkeypatch, problem):
    asked = []
    monkeypatch.setattr(check, "current_refusal", lambda head_dim: asked.append(head_dim) or problem)
    attention = checked(SimpleNamespace(kv_channels=256), 1, None, "self")
    assert asked == [256]  # once, at build
    q = torch.zeros(8, 2, 4)
    packed = SimpleNamespace(qkv_format="thd")
    assert attention(q, q, q, None).shape == (8, 8)  # plain rows: TE's, either way
    if problem:
        with pytest.raises(RuntimeError, match="the cuDNN story"):
            attention(q, q, q, None, packed_seq_params=packed)
        assert attention.calls == [None]
    else:
        attention(q, q, q, None, packed_seq_params=packed)
        assert attention.calls == [None, packed]


def test_the_te_spec_checks_attention_only_above_128(checked, monkeypatch):
    """TE's layer spec (megatron's portable one stands in for it: TE cannot load here) gets the checked core
    attention where the heads are above 128, megatron's own elsewhere, the rest of the spec unchanged."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    import twinkle_specs

    monkeypatch.setattr(spec, "get_gpt_layer_with_transformer_engine_spec", get_gpt_layer_local_spec)
    monkeypatch.setattr(spec, "checked_te_attention_class", lambda: checked)
    tiny = transformer_config_from_hf(
        twinkle_specs.__path__[0] + "/defaults/qwen3-tiny", transformer_impl="transformer_engine"
    )
    assert tiny.kv_channels <= 128
    plain = spec._megatron_layer_submodules(tiny)
    wide = spec._megatron_layer_submodules(dataclasses.replace(tiny, kv_channels=256))
    assert plain.self_attention.submodules.core_attention is not checked
    assert wide.self_attention.submodules.core_attention is checked
    core = plain.self_attention.submodules.core_attention
    assert (
        dataclasses.replace(wide.self_attention.submodules, core_attention=core)
        == plain.self_attention.submodules
    )
    assert wide.self_attention.module is plain.self_attention.module


def test_megatrons_parse_args_under_the_launcher_ends_in_the_refusal(monkeypatch):
    """The launcher's hook on Megatron's parse_args asks the check with the parsed args (before any rank builds
    a model) and ends the launch with its message."""
    import argparse

    from twinkle_specs import launch

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        args = extra_args_provider(argparse.ArgumentParser()).parse_args([])
        args.__dict__.update(vars(_args()))
        return args

    monkeypatch.setattr(launch, "_RUN", None)
    monkeypatch.setattr(check, "current_refusal", lambda head_dim: f"heads of {head_dim}")
    with pytest.raises(launch.LaunchError, match="^--sft: heads of 256$"):
        launch._wrap_parse_args(parse_args)()
    monkeypatch.setattr(check, "current_refusal", lambda head_dim: None)
    assert launch._wrap_parse_args(parse_args)().sft


def _wheel(site, version: str | None):
    """An ``nvidia`` folder as pip lays it out in ``site``; with ``version``, the cuDNN wheel in it, its
    dist-info (metadata and file list) beside."""
    (site / "nvidia" / "cublas" / "lib").mkdir(parents=True)
    if version is None:
        return None
    lib = site / "nvidia" / "cudnn" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcudnn.so.9").write_bytes(b"")
    info = site / f"nvidia_cudnn_cu13-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nvidia-cudnn-cu13\nVersion: {version}\n")
    (info / "RECORD").write_text(f"nvidia/cudnn/lib/libcudnn.so.9,,0\n{info.name}/METADATA,,\n")
    return lib


@pytest.mark.parametrize("first", ["9.19.0.56", None])
def test_the_wheels_cudnn_is_found_with_its_version(monkeypatch, tmp_path, first):
    """The nvidia-cudnn wheel as pip lays it out (a folder in the ``nvidia`` namespace package, its dist-info
    beside): the folder holding libcudnn.so.9 of the first such install on sys.path (whatever else is installed
    after it), and that install's version as cuDNN numbers it."""
    # named so that sorting the folders would pick the later one
    later = _wheel(tmp_path / "a-later", "9.14.0.64")
    earlier = _wheel(tmp_path / "z-earlier", first)
    monkeypatch.syspath_prepend(str(tmp_path / "a-later"))
    monkeypatch.syspath_prepend(str(tmp_path / "z-earlier"))
    lib, version = (earlier, 91900) if first else (later, 91400)
    assert check.wheel_cudnn_dir() == str(lib)
    assert check.wheel_cudnn() == (str(lib), version)


def test_the_installed_wheel_is_found_where_torch_brought_one():
    """Where an nvidia-cudnn wheel is installed for real (torch from PyPI brings one: the 0.19 leg's venv, the GPU
    image), the lookup finds it as the device scripts do (``nvidia.cudnn``'s folder) with that install's version."""
    cudnn = pytest.importorskip(
        "nvidia.cudnn", reason="no nvidia-cudnn wheel here (torch's CPU build brings none)"
    )
    found = check.wheel_cudnn()
    assert found is not None
    folder, version = found
    assert folder == str(Path(list(cudnn.__path__)[0], "lib")) and Path(folder, "libcudnn.so.9").is_file()
    installed = set()
    for wheel in check.WHEELS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            installed.add(".".join(importlib.metadata.version(wheel).split(".")[:3]))
    assert check.cudnn_name(version) in installed, (version, installed)
