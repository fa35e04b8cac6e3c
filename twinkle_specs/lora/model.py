"""Model-level LoRA training setup: freeze the base, keep gradients flowing under recompute, merge."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from ..parallel import is_adapter_param, model_chunks
from .fp8_copies import share_frozen_fp8_copies
from .layers import LoraBank, LoraLayerMixin
from .recompute import InputRecipe, RoutedTokens


def lora_modules(model) -> Iterator[tuple[int, str, LoraLayerMixin]]:
    """(chunk index, module name, LoRA layer) for every LoRA layer of this rank's model chunks."""
    for i, chunk in enumerate(model_chunks(model)):
        for name, module in chunk.named_modules():
            if isinstance(module, LoraLayerMixin) and module.lora_slots:
                yield i, name, module


def adapter_parameters(model) -> list[torch.nn.Parameter]:
    """The trainable parameters of a LoRA model: every adapter factor, nothing else."""
    return [p for chunk in model_chunks(model) for n, p in chunk.named_parameters() if is_adapter_param(n)]


def _require_grad_hook(_module: torch.nn.Module, _inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.requires_grad_(True) if not output.requires_grad else output


def prepare_lora_model(model) -> None:
    """Freezes every base parameter (embeddings, norms, output layer too) and keeps adapters trainable.

    With the embedding frozen, the decoder's input does not require grad, so a recomputed block
    (megatron's reentrant checkpoints: full recompute, and selective recompute of the MLP or MoE) whose
    input has no gradient produces an output without a graph and its adapters never get gradients. There,
    as PEFT's ``enable_input_require_grads`` does, the embedding output is made to require grad (a leaf
    with no weight gradient to compute), which lets that backward run; likewise under megatron's own CUDA
    graphs (:func:`_input_needs_grad`). Otherwise it is left without one: the first layer's input
    gradient (its QKV's input-gradient GEMM, its norm's backward) would be computed only to be dropped,
    and :func:`mark_first_layer_input` tells that layer's CUDA-graph capture so. Stages without the
    embedding receive activations that already require grad. Idempotent.
    """
    if not adapter_parameters(model):
        raise ValueError(
            "prepare_lora_model: the model has no LoRA factors; build it with lora=LoraConfig(...)"
        )
    for chunk in model_chunks(model):
        for name, param in chunk.named_parameters():
            param.requires_grad_(is_adapter_param(name))
        embedding = getattr(chunk, "embedding", None)
        if embedding is not None:
            needs_grad = _input_needs_grad(chunk.config)
            if needs_grad and not getattr(chunk, "_lora_input_hook", None):
                chunk._lora_input_hook = embedding.register_forward_hook(_require_grad_hook)
            mark_first_layer_input(chunk, needs_grad=needs_grad)
        link_input_recipes(chunk)
        keep_routed_counts_on_device(chunk)
        share_frozen_fp8_copies(chunk)
    bank_lora_factors(model)


def _input_needs_grad(config: Any) -> bool:
    """Whether the decoder's input must require grad: under recompute (a reentrant checkpoint's output has
    a graph only if an input requires grad) and under megatron's own CUDA graphs (``cuda_graph_impl
    local``, which megatron's config also sets for the deprecated ``enable_cuda_graph``: its capture
    differentiates each layer's output by the layer's inputs alone)."""
    return config.recompute_granularity is not None or getattr(config, "cuda_graph_impl", "none") == "local"


def mark_first_layer_input(chunk: torch.nn.Module, needs_grad: bool) -> None:
    """Tells the first decoder layer of the chunk holding the embedding whether its input will require
    grad (``input_needs_grad``, read by :class:`~twinkle_specs.spec.QwenTransformerLayer` when megatron
    makes its CUDA-graph sample input). megatron's sample always requires grad, so the captured backward
    would compute the input gradient that eager skips. Left requiring grad under virtual pipelining or
    megatron's per-layer MoE overlap schedule: there megatron and Transformer Engine may hand one layer's
    sample buffer to another layer of the same shapes, and a sample without grad under a layer whose
    input needs it would drop that gradient."""
    layers = getattr(getattr(chunk, "decoder", None), "layers", None)
    if not layers:
        return
    config = chunk.config
    virtual_stages = getattr(config, "virtual_pipeline_model_parallel_size", None) or 1
    shared_samples = virtual_stages > 1 or getattr(config, "overlap_moe_expert_parallel_comm", False)
    layers[0].input_needs_grad = needs_grad or shared_samples


def bank_lora_factors(model) -> None:
    """Moves each transformer layer's dense LoRA factors into one parameter per parallel kind
    (:class:`~twinkle_specs.lora.layers.LoraBank`): 28 adapter parameters instead of 224 on Qwen3-1.7B.

    Why: megatron's optimizer step (grad copies, clipping, Adam's lists, main-to-model copies) and DDP's
    per-parameter hooks cost host time per parameter, and a LoRA step has almost no GPU work in its
    optimizer phase to hide it behind: with a parameter per linear that phase took 15 ms of a 115 ms
    step on an H100. Routed experts (expert-parallel, with their own
    checkpoint offsets) keep their own parameters. Values are moved, not changed; idempotent.
    """
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for chunk in model_chunks(model):
        for layer in chunk.modules():
            if isinstance(layer, TransformerLayer):
                _bank_layer(layer)


def _bank_layer(layer: torch.nn.Module) -> None:
    kinds: dict[tuple, list[tuple[str, LoraLayerMixin, str]]] = {}
    for name, module in layer.named_modules():
        if not isinstance(module, LoraLayerMixin) or not module.lora_slots or module.lora_num_gemms:
            continue
        for which in "AB":
            if which in module.lora_banked:
                continue
            p = module.lora_leaf(which)
            if not getattr(p, "allreduce", True):
                continue  # routed experts
            tp = bool(getattr(p, "tensor_model_parallel", False))
            kind = (tp, bool(getattr(p, "sequence_parallel", False)), p.dtype, p.device, p.requires_grad)
            kinds.setdefault(kind, []).append((name, module, which))
    for (tp, sp, _, _, trainable), members in kinds.items():
        if len(members) < 2:
            continue
        leaves = [module.lora_leaf(which) for _, module, which in members]
        # [1, n], not [n]: megatron exempts 1-D parameters (biases, norms) from weight decay
        flat = torch.cat([p.detach().reshape(-1) for p in leaves]).view(1, -1)
        bank = torch.nn.Parameter(flat, requires_grad=trainable)
        set_tensor_model_parallel_attributes(bank, tp, 1, 1)
        if sp:
            bank.sequence_parallel = True
        owner, name = members[0][1], "lora_bank_tp" if tp else "lora_bank"
        lora_bank = LoraBank(name, bank, members, [tuple(p.shape) for p in leaves])
        for index, (_, module, which) in enumerate(members):
            del module._parameters[f"lora_{which}"]
            module.lora_banked[which] = (lora_bank, index)
        owner.register_parameter(name, bank)
        owner.lora_banks.append(lora_bank)


def swiglu_eager(pre: torch.Tensor) -> torch.Tensor:
    """megatron's unfused gated-SiLU (``glu`` in MLP.forward without clamp or offset)."""
    gate, up = torch.chunk(pre, 2, dim=-1)
    return F.silu(gate) * up


def on_2d(fn: Callable[[torch.Tensor], torch.Tensor], pre: torch.Tensor) -> torch.Tensor:
    """``fn`` of the [tokens, 2F] view of ``pre``, as megatron's ``bias_swiglu_impl`` calls its compiled
    SwiGLU: ``torch.compile`` specialises on the rank, and a 3-D call compiles a second, dynamic-shape
    kernel (238 us against 95 per call on the Qwen3-8B shape, H100)."""
    return fn(pre.reshape(-1, pre.shape[-1])).view(*pre.shape[:-1], -1)


def swiglu_fn(config) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How the MLP turns fc1's output into fc2's input, where that is plain SwiGLU and SwiGLU keeps its
    input as is (no bias, clamp or offset, no TE activation op, no fp8 input store, no activation
    offloading); None otherwise."""
    plain_swiglu = (
        config.gated_linear_unit and config.activation_func is F.silu and not config.add_bias_linear
    )
    unchanged = not any(
        getattr(config, name, None)
        for name in (
            "activation_func_clamp_value",
            "glu_linear_offset",
            "use_te_activation_func",
            "activation_func_fp8_input_store",
            "cpu_offloading",
            "fine_grained_activation_offloading",
        )
    )
    if not (plain_swiglu and unchanged):
        return None
    if config.bias_activation_fusion:
        from megatron.core.fusions.fused_bias_swiglu import swiglu

        return functools.partial(on_2d, swiglu)
    return swiglu_eager


def _link(producer: Any, consumer: Any, fn: Callable | None, name: str, *, from_input: bool) -> None:
    """An :class:`InputRecipe` from ``producer`` to the adapted linear ``consumer``, where both are
    there and the consumer has none yet."""
    if not isinstance(consumer, LoraLayerMixin) or not consumer.lora_slots or consumer.lora_num_gemms:
        return  # grouped experts: per-expert token blocks, their own path
    if consumer.lora_input_recipe or fn is None or not isinstance(producer, torch.nn.Module):
        return
    recipe = InputRecipe(fn, name, from_input=from_input)
    producer.register_forward_hook(recipe.put)
    consumer.lora_input_recipe = recipe


def link_input_recipes(chunk: torch.nn.Module) -> None:
    """Gives each adapted linear whose input's producer is known an :class:`InputRecipe` (idempotent):
    an MLP's ``linear_fc2`` (from its ``linear_fc1`` through plain SwiGLU), and a layer's ``linear_qkv``
    and dense ``linear_fc1`` from the norm before them where that norm is a module of its own (the
    portable spec, and the TE spec as LoRA builds it: :mod:`twinkle_specs.lora.spec`); the routed
    experts' grouped ``linear_fc1`` a :class:`RoutedTokens` from the router, where that holds."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayer

    def norm_fn(norm: Any) -> Callable | None:
        if isinstance(norm, IdentityOp):
            return None
        if type(norm).__module__.startswith("transformer_engine."):
            from .te_layers import te_norm_recompute

            return te_norm_recompute(norm)
        if hasattr(norm, "lora_input_fn"):  # norm.HiddenNorm
            return norm.lora_input_fn()
        return getattr(norm, "forward", None)

    for name, module in chunk.named_modules():
        if isinstance(module, TransformerLayer):
            attn, mlp = module.self_attention, module.mlp
            qkv = getattr(attn, "linear_qkv", None)
            norm = module.input_layernorm
            _link(norm, qkv, norm_fn(norm), f"{name}.self_attention.linear_qkv", from_input=True)
            norm = module.pre_mlp_layernorm
            fc1 = getattr(mlp, "linear_fc1", None)
            _link(norm, fc1, norm_fn(norm), f"{name}.mlp.linear_fc1", from_input=True)
        fc1, fc2 = getattr(module, "linear_fc1", None), getattr(module, "linear_fc2", None)
        if isinstance(fc2, LoraLayerMixin):
            _link(fc1, fc2, swiglu_fn(module.config), f"{name}.linear_fc2", from_input=False)
        fc1 = getattr(getattr(module, "experts", None), "linear_fc1", None)
        if isinstance(fc1, LoraLayerMixin) and fc1.lora_num_gemms and not fc1.lora_input_recipe:
            if _routed_tokens_are_gathered(module):
                recipe = RoutedTokens(f"{name}.experts.linear_fc1")
                module.router.register_forward_hook(recipe.put)
                fc1.lora_input_recipe = recipe


def keep_routed_counts_on_device(chunk: torch.nn.Module) -> None:
    """Asks each MoE layer's token dispatcher to leave the routed token counts on the GPU where its
    experts take them there (``mlp.CountsOnDevice.host_counts_reason`` finds nothing): the dispatcher then
    neither copies them to the host nor waits for that copy (``patches/moe_counts_on_device.py``, which also
    decides where nothing else needs them on the host); where the experts need them, the dispatcher keeps
    the reason, for the error a CUDA graph capture of that wait raises. Idempotent."""
    for module in chunk.modules():
        dispatcher, experts = getattr(module, "token_dispatcher", None), getattr(module, "experts", None)
        reason = getattr(experts, "host_counts_reason", None)  # mlp.CountsOnDevice
        if dispatcher is not None and reason is not None:
            dispatcher.host_counts_reason = reason()
            dispatcher.counts_on_device = dispatcher.host_counts_reason is None


def _routed_tokens_are_gathered(moe: Any) -> bool:
    """Whether a MoE layer's routed experts see the router's input gathered in routing order and
    nothing else (:class:`~twinkle_specs.lora.recompute.RoutedTokens`): megatron's all-to-all or
    all-gather dispatcher with one expert-parallel and one expert-tensor-parallel rank (no tokens from
    other ranks), no capacity (dropped or padded tokens), no fp8/fp4 padding, no latent projection or
    probabilities applied to the input, and no CUDA graph (a captured router does not run its hooks)."""
    config, dispatcher = moe.config, getattr(moe, "token_dispatcher", None)
    if getattr(moe, "router", None) is None or dispatcher is None:
        return False
    if config.moe_token_dispatcher_type not in ("alltoall", "allgather"):
        return False
    if dispatcher.ep_size != 1 or dispatcher.tp_size != 1:
        return False
    changed = (
        "moe_expert_capacity_factor",
        "moe_pad_expert_input_to_capacity",
        "moe_router_padding_for_quantization",
        "moe_router_padding_for_fp8",
        "moe_latent_size",
        "moe_apply_probs_on_input",
        "fp8",
        "fp4",
        "enable_cuda_graph",
        "external_cuda_graph",
    )
    if any(getattr(config, field, None) for field in changed):
        return False
    return getattr(config, "cuda_graph_impl", "none") in (None, "none")


def merge_lora(model) -> None:
    """Folds every adapter into its base weight (fp32 arithmetic, cast once to the weight's dtype).

    Afterwards the base weights are the merged model (``save_hf_weights`` exports it) and the adapters
    are skipped in forward. :func:`unmerge_lora` restores the exact base.
    """
    for _, _, module in lora_modules(model):
        module.merge()


def unmerge_lora(model) -> None:
    """Restores the base weights bit-for-bit and re-enables the adapters."""
    for _, _, module in lora_modules(model):
        module.unmerge()
