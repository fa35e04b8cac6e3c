"""A layer's residual add writes into the next layer's CUDA-graph sample while captured
(``twinkle_specs.graph_io``), on CPU tensors with the capture flag faked: where it applies the output is that
buffer and holds ``residual + x`` bit for bit, gradients reach both summands; elsewhere megatron's own
bias-dropout-add runs. The captured graphs themselves (Transformer Engine, a GPU) are checked by the GPU
tests that train under them (``tests/test_launch_gpu.py``, the CUDA-graph runs against eager)."""

from __future__ import annotations

import pytest
import torch
from conftest import cpu_reference
from test_lora_support import make_checkpoint, single_rank  # noqa: F401  (fixture)

import twinkle_specs as ts
from twinkle_specs.graph_io import OutputIntoNextInput, record_sample

pytestmark = cpu_reference


@pytest.fixture(scope="module")
def model(tmp_path_factory, single_rank):  # noqa: F811
    return ts.build_model(make_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3")))


@pytest.fixture
def capturing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


def _summands(shape=(8, 1, 64)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(*shape, generator=g).requires_grad_(),
        torch.randn(*shape, generator=g).requires_grad_(),
    )


def _add(layer, x, residual, bias=None, prob=0.0, training=True) -> torch.Tensor:
    return layer.mlp_bda(training, False)((x, bias), residual, prob)


def test_output_goes_into_the_next_layers_sample(model, capturing):
    first, second = model.decoder.layers
    assert isinstance(first.mlp_bda, OutputIntoNextInput)
    model.config.__dict__.pop("_twinkle_graph_samples", None)
    residual, x = _summands()
    sample = torch.ones(8, 1, 64, requires_grad=True)  # as megatron makes it
    record_sample(second, sample)
    out = _add(first, x, residual)
    assert out.data_ptr() == sample.data_ptr() and type(out.grad_fn).__name__ == "_AddIntoBackward"
    assert torch.equal(out, residual + x) and torch.equal(sample.detach(), residual + x)
    (out * torch.arange(64.0)).sum().backward()
    assert torch.equal(residual.grad, x.grad) and torch.equal(x.grad[0, 0], torch.arange(64.0))


@pytest.mark.parametrize(
    "case", ["two samples", "freed", "last layer", "bias", "dropout", "shape", "not capturing"]
)
def test_megatrons_add_runs_elsewhere(model, capturing, monkeypatch, case):
    first, second = model.decoder.layers
    model.config.__dict__.pop("_twinkle_graph_samples", None)
    residual, x = _summands()
    sample = torch.zeros(4, 1, 64) if case == "shape" else torch.zeros(8, 1, 64)
    record_sample(second, torch.zeros(8, 1, 64) if case == "freed" else sample)  # held weakly: freed at once
    layer, kwargs = first, {}
    if case == "two samples":  # several micro-batches in flight: a buffer each
        record_sample(second, torch.zeros(8, 1, 64))
    elif case == "last layer":
        record_sample(type("Next", (), {"config": model.config, "layer_number": 3})(), torch.zeros(8, 1, 64))
        layer = second
    elif case == "bias":
        kwargs = dict(bias=torch.ones(64))
    elif case == "dropout":
        kwargs = dict(prob=0.1, training=True)
    elif case == "not capturing":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    torch.manual_seed(0)
    out = _add(layer, x, residual, **kwargs)
    assert out.data_ptr() != sample.data_ptr() and not sample.any()
    assert type(out.grad_fn).__name__ != "_AddIntoBackward"  # megatron's function made it
    if case in ("two samples", "freed", "last layer", "shape", "not capturing"):
        assert torch.equal(out, residual + x)
