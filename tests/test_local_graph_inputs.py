"""patches/local_graph_inputs_kept.py on this host: megatron's own graph buffer pool, the patched forward
capture keeping its input buffer from the next capture that asks the pool, and the gate following upstream's
code. The replays themselves need CUDA (tests/test_launch_gpu.py, local graphs against eager)."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from twinkle_specs.patches import local_graph_inputs_kept
from twinkle_specs.patches.gates import megatron_core_in

cuda_graphs = pytest.importorskip("megatron.core.transformer.cuda_graphs")
OLD_POOL = megatron_core_in("0.16", "0.18")
needs_old_pool = pytest.mark.skipif(
    not OLD_POOL, reason="megatron-core 0.18+ no longer returns a forward capture's inputs to a pool"
)


def test_gated_to_the_cores_whose_forward_capture_returns_its_inputs_to_the_pool():
    """The version gate follows the code: is_needed (its CUDA condition aside) exactly where the installed
    megatron-core's create_fwd_graph hands buffers back to the reuse pool."""
    source = inspect.getsource(cuda_graphs._CudaGraphRunner.create_fwd_graph)
    assert ("tensor_reuse_pool.insert(" in source) == OLD_POOL
    assert not local_graph_inputs_kept.is_needed()  # no CUDA here: never applied on this host


@pytest.fixture
def pool(monkeypatch):
    """megatron's global reuse pool, emptied for the test (its lists are class attributes)."""
    pool_cls = cuda_graphs.TensorReusePool
    for name, value in (("pool", []), ("tensor_strong_refs", []), ("tensor_strong_refs_dataptrs", set())):
        monkeypatch.setattr(pool_cls, name, value)
    return cuda_graphs._CudagraphGlobalRecord.tensor_reuse_pool


def _capture_forward(runner, meta):
    """What upstream's create_fwd_graph does with a layer's copied-in input: a buffer from the pool, and
    (0.16/0.17) the buffer handed back after the capture."""
    buf = cuda_graphs._CudagraphGlobalRecord.tensor_reuse_pool.get(meta)
    runner.saved_input = buf  # what the captured forward keeps for its backward
    cuda_graphs._CudagraphGlobalRecord.tensor_reuse_pool.insert(buf)
    return buf


@needs_old_pool
@pytest.mark.parametrize("patched", [False, True], ids=["upstream", "patched"])
def test_the_next_capture_gets_a_buffer_of_its_own(pool, patched):
    """Upstream, the last layer's backward capture asking for its incoming gradient's buffer ([s, b, h], like
    the first layer's input) gets the first layer's saved input; patched, a new buffer. After the forward
    capture the pool takes buffers back again (the backward captures return theirs)."""
    capture = local_graph_inputs_kept.keep_inputs(_capture_forward) if patched else _capture_forward
    meta = cuda_graphs.ArgMetadata(torch.zeros(8, 2, 16, dtype=torch.bfloat16))
    runner = type("Runner", (), {})()
    saved = capture(runner, meta)
    grad_buffer = pool.get(meta)
    assert (grad_buffer.data_ptr() == saved.data_ptr()) is not patched
    pool.insert(grad_buffer)
    assert pool.get(meta) is grad_buffer
    assert "insert" not in vars(pool)  # the class's own insert again


@needs_old_pool
def test_applied_once_to_megatrons_runner(monkeypatch):
    runner = cuda_graphs._CudaGraphRunner
    monkeypatch.setattr(runner, "create_fwd_graph", runner.create_fwd_graph)
    upstream = runner.create_fwd_graph
    local_graph_inputs_kept.apply()
    local_graph_inputs_kept.apply()
    assert runner.create_fwd_graph.keeps_inputs and runner.create_fwd_graph.__wrapped__ is upstream


def test_a_local_graphs_model_without_the_patch_is_warned(monkeypatch):
    """Where the patch is needed (here pretended: it needs CUDA) and not in force, a model under megatron's
    local graphs warns, naming the patch and the ways to get it; TE's graphs or the patch in force: silent."""
    from types import SimpleNamespace

    runner = cuda_graphs._CudaGraphRunner
    monkeypatch.setattr(runner, "create_fwd_graph", runner.create_fwd_graph)
    monkeypatch.setattr(local_graph_inputs_kept, "is_needed", lambda: True)
    with pytest.warns(UserWarning, match=r"local_graph_inputs_kept.*twinkle_specs\.apply_patches\(\)"):
        local_graph_inputs_kept.warn_if_missing(SimpleNamespace(cuda_graph_impl="local"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        local_graph_inputs_kept.warn_if_missing(SimpleNamespace(cuda_graph_impl="transformer_engine"))
        local_graph_inputs_kept.apply()
        local_graph_inputs_kept.warn_if_missing(SimpleNamespace(cuda_graph_impl="local"))


def test_every_layer_of_the_spec_runs_the_check(monkeypatch, checkpoints, megatron_single):
    """The spec's layers run the check with their config as they are built (a model under local graphs
    cannot be built on this host: megatron's graph manager needs CUDA's RNG tracker)."""
    import twinkle_specs as ts

    seen = []
    monkeypatch.setattr(local_graph_inputs_kept, "warn_if_missing", seen.append)
    model = ts.build_model(checkpoints("qwen3"))
    assert seen == [model.config] * len(model.decoder.layers) and seen
