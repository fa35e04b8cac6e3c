"""A frozen base's FP8 weight copies under TE's CUDA graphs (twinkle_specs.lora.fp8_copies): when a model
chunk's graphed layers quantize their weights again, and how a built LoRA model wires it. The GPU side (the
same losses as the eager run, the copies kept) is tests/test_launch_gpu.py's FP8 graphs test."""

from __future__ import annotations

import types

import pytest
import torch
from test_lora_support import single_rank  # noqa: F401  (fixture)

import twinkle_specs as ts
from twinkle_specs import LoraConfig
from twinkle_specs.lora import prepare_lora_model
from twinkle_specs.lora.fp8_copies import FrozenFp8Copies, copies_to_settle


def _config(fp8: str | None, recipe: object = "delayed") -> types.SimpleNamespace:
    return types.SimpleNamespace(fp8=fp8, fp8_recipe=recipe)


def test_copies_to_settle_by_recipe():
    enum_like = types.SimpleNamespace(value="tensorwise")  # megatron's Fp8Recipe enum
    assert copies_to_settle(_config("hybrid", "delayed")) == 2
    assert copies_to_settle(_config("e4m3", enum_like)) == 1
    assert copies_to_settle(_config("hybrid", "blockwise")) == 1
    assert copies_to_settle(_config(None)) == 0  # bf16: megatron's flag
    assert copies_to_settle(_config("hybrid", "custom")) == 0  # a quantizer this does not know
    assert copies_to_settle(None) == 0


def _iterations(copies: FrozenFp8Copies, layers: list, n: int) -> list[list[bool]]:
    """Each iteration's answers, every layer in order, at micro-batch 0 and then at micro-batch 1."""
    return [
        [copies.first_microbatch(layer, True) for layer in layers]
        + [copies.first_microbatch(layer, False) for layer in layers]
        for _ in range(n)
    ]


@pytest.mark.parametrize("recipe,settle", [("delayed", 2), ("tensorwise", 1)])
def test_graphs_keep_copies_once_settled(recipe, settle, capsys):
    weights = [torch.randn(4, 4), torch.randn(8)]
    copies = FrozenFp8Copies(weights, copies_to_settle(_config("hybrid", recipe)))
    layers = ["layer 1", "layer 2", "layer 3"]
    quantize, keep = [True] * 3 + [False] * 3, [False] * 6
    assert _iterations(copies, layers, settle + 2) == [quantize] * settle + [keep] * 2
    assert copies.kept_from == settle + 1
    assert f"kept from its iteration {settle + 1} on" in capsys.readouterr().out

    # a base weight written in place (a load, a merge): quantized again until settled again
    with torch.no_grad():
        weights[0].add_(1.0)
    assert _iterations(copies, layers, settle + 1) == [quantize] * settle + [keep]
    assert capsys.readouterr().out == ""  # said once

    # a new storage (a weight replaced) counts as a change too
    weights[1] = torch.randn(8)
    assert _iterations(copies, layers, 1) == [quantize]


def test_graphs_follow_megatron_while_a_base_weight_trains():
    trained = torch.nn.Parameter(torch.randn(4, 4))
    copies = FrozenFp8Copies([torch.randn(4, 4), trained], 1)
    assert _iterations(copies, ["a", "b"], 3) == [[True, True, False, False]] * 3


def test_the_lead_layer_decides_for_the_forward():
    """TE takes the first graphed module's flag for the whole forward, so the others follow the lead
    layer's decision of that iteration whatever they would have said."""
    copies = FrozenFp8Copies([torch.randn(2, 2)], 1)
    assert copies.first_microbatch("lead", True) is True
    assert copies.first_microbatch("other", True) is True
    assert copies.first_microbatch("other", True) is True  # no new decision from a follower
    assert copies.first_microbatch("lead", True) is False
    assert copies.first_microbatch("other", True) is False


@pytest.mark.parametrize("fp8", [None, "hybrid"])
def test_a_lora_model_shares_one_decision_per_chunk(fp8, lora_checkpoints, single_rank, monkeypatch):  # noqa: F811
    """``prepare_lora_model`` gives an FP8 LoRA model's layers one FrozenFp8Copies over every layer's base
    weights (no adapter), and the layer's TE graph replay arguments go through it; a bf16 model has none."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    model = ts.build_model(lora_checkpoints("qwen3"), lora=LoraConfig(r=4, target_modules="all-linear"))
    layers = list(model.decoder.layers)
    if fp8 is None:
        assert not any(hasattr(layer, "lora_fp8_copies") for layer in layers)
        return
    model.config.fp8, model.config.fp8_recipe = fp8, "tensorwise"  # the layers share this config
    prepare_lora_model(model)  # idempotent: as a model built under FP8 gets it
    copies = layers[0].lora_fp8_copies
    assert all(layer.lora_fp8_copies is copies for layer in layers)
    base = [p for layer in layers for n, p in layer.named_parameters() if ".lora_" not in n]
    assert [id(w) for w in copies._weights] == [id(p) for p in base]
    assert len(base) < len(list(p for layer in layers for p in layer.parameters()))  # adapters left out

    def megatron_args(self, *args, **kwargs):  # megatron's: micro-batch 0 asks for new copies
        return args, dict(kwargs, is_first_microbatch=True)

    monkeypatch.setattr(TransformerLayer, "_get_te_cuda_graph_replay_args", megatron_args)
    hidden = torch.zeros(1)
    asked = [[layer._get_te_cuda_graph_replay_args(hidden)[1]["is_first_microbatch"] for layer in layers]]
    asked.append([layer._get_te_cuda_graph_replay_args(hidden)[1]["is_first_microbatch"] for layer in layers])
    assert asked == [[True] * len(layers), [False] * len(layers)]
