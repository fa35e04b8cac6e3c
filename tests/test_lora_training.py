"""LoRA training semantics on CPU (portable path, fp32, TP=1): frozen base, gradients under full
activation recompute, a short run that lowers the loss without touching the base, merge/unmerge."""

from __future__ import annotations

import peft
import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_reference
from test_lora_support import (
    VOCAB,
    hf_model,
    make_checkpoint,
    megatron_logits,
    randomize_megatron,
    single_rank,  # noqa: F401  (fixture)
    tokens,
)

import twinkle_specs as ts
from twinkle_specs import LoraConfig, export_peft_adapter, merge_lora, unmerge_lora
from twinkle_specs.export import save_hf_weights
from twinkle_specs.lora import adapter_parameters
from twinkle_specs.parallel import is_adapter_param

pytestmark = cpu_reference


TOL = 1e-4  # fp32 logits, max |Δ|
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture
def host_rng(monkeypatch):
    """megatron's recompute saves/restores CUDA RNG states, which a CPU-only torch cannot read; keep
    the CPU generator's state only (what the recomputed forward needs here: no dropout is active)."""
    import megatron.core.tensor_parallel.random as rng

    monkeypatch.setattr(rng, "_get_all_rng_states", lambda: (torch.get_rng_state(), None, {}))
    monkeypatch.setattr(rng, "_set_all_rng_states", lambda cpu, _cuda, _tracker: torch.set_rng_state(cpu))


def _loss(model, toks: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(toks.shape[1]).expand_as(toks)
    logits = model(toks, pos, None)[..., :VOCAB]
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), toks[:, 1:].reshape(-1))


def _adapter_grads(model) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.clone() for n, p in model.named_parameters() if is_adapter_param(n) and p.grad is not None
    }


def test_only_adapters_train(hf, single_rank):  # noqa: F811
    model = ts.build_model(hf, lora=LoraConfig(r=4, target_modules="all-linear"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    adapters = {n for n, _ in model.named_parameters() if is_adapter_param(n)}
    # each layer's factors (4 linears x (A, B)) in one bank, held by its first adapted linear in module
    # order (megatron's attention registers linear_proj before linear_qkv)
    assert (
        trainable
        == adapters
        == {f"decoder.layers.{i}.self_attention.linear_proj.lora_bank" for i in range(2)}
    )
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    for must in ("embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"):
        assert must in frozen
    assert len(adapter_parameters(model)) == len(adapters)


def test_banked_factors_train_exactly_as_separate_ones(hf, single_rank, monkeypatch):  # noqa: F811
    """``prepare_lora_model`` moves each layer's factors into one parameter (``bank_lora_factors``):
    the loss and every factor's gradient are bit-identical to a model whose linears keep their own
    factors, a ``rank_pattern`` (B wider than a slot's rank) included."""
    import twinkle_specs.lora.model as lora_model
    from twinkle_specs.lora.peft_io import factors

    lora = LoraConfig(r=4, target_modules="all-linear", rank_pattern={"q_proj": 2, "down_proj": 6})
    banked = ts.build_model(hf, lora=lora)
    monkeypatch.setattr(lora_model, "bank_lora_factors", lambda model: None)
    separate = ts.build_model(hf, lora=lora)
    assert len(adapter_parameters(banked)) == 2 and len(adapter_parameters(separate)) == 2 * 4 * 2
    runs = []
    for model in (banked, separate):
        randomize_megatron(model)
        loss = _loss(model, tokens())
        loss.backward()
        runs.append((loss.detach(), [f.grad.clone() for f in factors(model)]))
    (loss, grads), (want_loss, want) = runs
    assert torch.equal(loss, want_loss)
    assert len(grads) == len(want) == 2 * 7 * 2  # layers x projections x (A, B)
    assert all(g.abs().max() > 0 for g in want)
    assert all(torch.equal(g, w) for g, w in zip(grads, want, strict=True))


def test_adapter_grads_under_full_recompute(hf, single_rank, host_rng):  # noqa: F811
    lora = LoraConfig(r=4, target_modules="all-linear")
    plain = ts.build_model(hf, lora=lora)
    randomize_megatron(plain)
    _loss(plain, tokens()).backward()
    want = _adapter_grads(plain)

    model = ts.build_model(hf, lora=lora, **RECOMPUTE)
    randomize_megatron(model)
    _loss(model, tokens()).backward()
    got = _adapter_grads(model)
    assert sorted(got) == sorted(want)
    assert all(g.abs().max() > 0 for g in got.values()), "an adapter got a zero gradient"
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5

    # Without the input hook the recomputed block has no graph: this is the bug the hook fixes.
    model.zero_grad(set_to_none=True)
    model._lora_input_hook.remove()
    assert not _loss(model, tokens()).requires_grad


def test_first_layer_input_gradient_is_not_computed_without_recompute(hf, single_rank, monkeypatch):  # noqa: F811
    """Without recompute the decoder's input keeps no gradient (the embedding is frozen): the first layer's
    input gradient is not computed, eager or in its CUDA-graph capture (the sample megatron makes for it
    has none), and the adapters' gradients are bit for bit those of a run whose input requires grad."""
    from twinkle_specs.lora.model import _require_grad_hook, mark_first_layer_input

    model = ts.build_model(hf, lora=LoraConfig(r=4, target_modules="all-linear"))
    randomize_megatron(model)
    first, second = model.decoder.layers[0], model.decoder.layers[1]
    assert first.input_needs_grad is False and not hasattr(second, "input_needs_grad")
    assert not getattr(model, "_lora_input_hook", None)
    seen = []
    for layer in (first, second):
        layer.register_forward_pre_hook(
            lambda m, a, k: seen.append(k["hidden_states"].requires_grad), with_kwargs=True
        )
    _loss(model, tokens()).backward()
    assert seen == [False, True]
    got = _adapter_grads(model)

    model.zero_grad(set_to_none=True)
    hook = model.embedding.register_forward_hook(_require_grad_hook)  # the input requiring grad
    _loss(model, tokens()).backward()
    hook.remove()
    want = _adapter_grads(model)
    assert sorted(got) == sorted(want) and all(g.abs().max() > 0 for g in got.values())
    assert all(torch.equal(got[k], want[k]) for k in want)

    # megatron's CUDA-graph samples (made on the current CUDA device: here the host)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    assert not first.get_layer_static_inputs(8, 1)["hidden_states"].requires_grad
    assert second.get_layer_static_inputs(8, 1)["hidden_states"].requires_grad
    with pytest.raises(RuntimeError, match="captured without its input's gradient"):
        first._te_cuda_graph_replay(hidden_states=torch.zeros(8, 1, 4, requires_grad=True))

    # virtual pipelining may hand this layer's sample to another layer: it keeps the gradient there
    monkeypatch.setattr(model.config, "virtual_pipeline_model_parallel_size", 2)
    mark_first_layer_input(model, needs_grad=False)
    assert first.input_needs_grad is True
    assert first.get_layer_static_inputs(8, 1)["hidden_states"].requires_grad


def test_recompute_keeps_the_first_layer_input_gradient(hf, single_rank):  # noqa: F811
    """Under recompute (full, or selective: megatron's reentrant checkpoints around the MLP or MoE) the
    decoder's input requires grad, so a recomputed block's adapters get gradients; so does it under megatron's
    own CUDA graphs (their capture differentiates by the layer's inputs), not under TE's."""
    from types import SimpleNamespace

    from twinkle_specs.lora.model import _input_needs_grad

    for impl, needed in (("local", True), ("transformer_engine", False), ("none", False)):
        assert _input_needs_grad(SimpleNamespace(recompute_granularity=None, cuda_graph_impl=impl)) is needed
    for recompute in (RECOMPUTE, dict(recompute_granularity="selective", recompute_modules=["mlp"])):
        model = ts.build_model(hf, lora=LoraConfig(r=4, target_modules=["up_proj"]), **recompute)
        assert model._lora_input_hook is not None and model.decoder.layers[0].input_needs_grad is True


def test_short_training_lowers_loss_and_keeps_base(hf, single_rank, host_rng):  # noqa: F811
    model = ts.build_model(hf, lora=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"), **RECOMPUTE)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter_param(n)}
    opt = torch.optim.AdamW(adapter_parameters(model), lr=1e-2)
    toks = tokens(s=32)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = _loss(model, toks)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), f"base weight {n} changed"


def test_merge_unmerge_and_merged_export(hf, single_rank, tmp_path):  # noqa: F811
    model = ts.build_model(
        hf, lora=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    )
    model.eval()
    randomize_megatron(model)
    with_adapter = megatron_logits(model, tokens())
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter_param(n)}
    merge_lora(model)
    merged = megatron_logits(model, tokens())
    assert (merged - with_adapter).abs().max().item() <= TOL
    changed = [n for n, p in model.named_parameters() if n in base and not torch.equal(p, base[n])]
    assert changed and all(("linear_qkv" in n or "linear_fc" in n) for n in changed)

    save_hf_weights(model, tmp_path / "merged")
    unmerge_lora(model)
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), f"unmerge did not restore {n}"
    assert torch.equal(megatron_logits(model, tokens()), with_adapter)

    # The merged HF checkpoint equals HF + the exported PEFT adapter, and PEFT's own merge.
    export_peft_adapter(model, tmp_path / "adapter")
    reference = peft.PeftModel.from_pretrained(hf_model(hf), tmp_path / "adapter").eval()
    with torch.no_grad():
        ref = reference(tokens()).logits
        merged_hf = hf_model(tmp_path / "merged")(tokens()).logits
        peft_merged = reference.merge_and_unload()(tokens()).logits
    assert (merged_hf - ref).abs().max().item() <= TOL
    assert (merged_hf - peft_merged).abs().max().item() <= TOL
    assert (merged_hf - with_adapter).abs().max().item() <= TOL


def test_resume_from_adapter_only_checkpoint_continues_the_loss_curve(hf, single_rank, tmp_path):  # noqa: F811
    """6 steps straight == 3 steps, adapter-only checkpoint, fresh model from the HF base, 3 steps.

    The checkpoint here is the gathered PEFT directory (megatron-core 0.16's torch_dist writer needs
    CUDA; the GPU tests save/load the sharded one). SGD keeps no optimizer state, so the adapter alone
    determines the continuation.
    """
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    toks = tokens(s=32)

    def run(model, steps: int) -> list[float]:
        opt = torch.optim.SGD(adapter_parameters(model), lr=0.5)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = _loss(model, toks)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    torch.manual_seed(0)
    straight = run(ts.build_model(hf, lora=lora), 6)
    torch.manual_seed(0)
    first = ts.build_model(hf, lora=lora)
    head = run(first, 3)
    export_peft_adapter(first, tmp_path / "ckpt")
    resumed = ts.build_model(hf, lora=LoraConfig.from_peft(tmp_path / "ckpt"))
    ts.load_peft_adapter(resumed, tmp_path / "ckpt")
    tail = run(resumed, 3)
    assert straight[0] > straight[-1]  # it trains
    assert head == straight[:3]
    assert max(abs(a - b) for a, b in zip(tail, straight[3:], strict=True)) <= 1e-6, (straight, head + tail)


def test_lora_model_builds_the_fused_swiglu_mlp(hf, single_rank):  # noqa: F811
    """Every dense MLP of a LoRA model built from megatron-core's own layer spec is LoraMLP, with fc1's
    delta going into SwiGLU. megatron-core 0.16 specs the MLP as ``ModuleSpec(MLP)`` and 0.19 as
    ``partial(MLP.as_mlp_submodule)``; a spec that missed the latter would keep megatron's MLP, and the
    LoRA step would run without the fused SwiGLU (8B shape on an H200: 72.5 against 69.9 ms). CI runs
    0.16; run this file with 0.19 on the path for the other."""
    from twinkle_specs.lora.mlp import LoraMLP

    model = ts.build_model(
        hf, lora=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), bias_activation_fusion=True
    )
    mlps = [layer.mlp for layer in model.decoder.layers]
    assert mlps and all(type(m) is LoraMLP and m.lora_fuses_activation for m in mlps), mlps


def test_forward_without_autograd_is_the_training_forward_bit_for_bit(hf, single_rank):  # noqa: F811
    """Evaluation (no autograd) runs the adapter's A GEMM with its scaling as alpha, as training does, so
    a bf16 model gives the same logits either way. The scaling 8/6 is not a power of two: multiplying
    ``h`` by it afterwards rounds twice and moves last bits."""
    model = ts.build_model(
        hf,
        lora=LoraConfig(r=6, lora_alpha=8, target_modules="all-linear"),
        params_dtype=torch.bfloat16,
        bf16=True,
    )
    randomize_megatron(model)
    toks = tokens()
    pos = torch.arange(toks.shape[1]).expand_as(toks)
    trained = model(toks, pos, None)
    assert trained.requires_grad
    with torch.no_grad():
        evaluated = model(toks, pos, None)
    assert torch.equal(evaluated, trained.detach()), (evaluated - trained).abs().max()
