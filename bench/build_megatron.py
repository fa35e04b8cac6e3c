"""The Megatron-side variants: (a) megatron-core's own TE spec, (b)-(c) twinkle_specs full and LoRA,
(e) twinkle_specs all frozen, (g) (c) on packed SFT rows. Each is built fresh and seeded (its initial
weights do not depend on what was built before it in this process) with megatron-core DDP and
``get_megatron_optimizer`` on a GPU; on CPU megatron's DDP cannot run (its buffers are CUDA tensors), so
torch AdamW on the trainable parameters stands in, and the result says so. CUDA graphs
(``Settings.cuda_graphs``) are captured here, before any timing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .device import device, on_gpu
from .load_timing import time_load
from .packed_rows import packed_row
from .settings import Prepared, Settings, count_params, lora_config
from .timing import CLOCK, median_cuda_ms

# (model, facts for the result) from (hf_dir, settings, TransformerConfig overrides)
ModelFn = Callable[[Path, Settings, dict[str, Any]], tuple[Any, dict[str, Any]]]


def init_megatron(s: Settings) -> None:
    """World size 1: gloo on CPU, NCCL on a GPU; model-parallel RNG (cuda-graph safe when needed)."""
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if on_gpu():
            torch.cuda.set_device(0)
        # a fresh port of our own (an inherited MASTER_PORT may belong to another process)
        dist.init_process_group(
            "nccl" if on_gpu() else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
        )
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    if on_gpu():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        # CUDA graphs need TE's graph-safe RNG tracker (TE attention asserts it), local graphs also
        # megatron's graphable RNG; TE graphs size their warm-up by megatron's micro-batch calculator.
        graphs = s.cuda_graphs != "none"
        model_parallel_cuda_manual_seed(
            s.seed,
            te_rng_tracker=graphs,
            use_cudagraphable_rng=s.cuda_graphs in ("local", "full_iteration"),
            force_reset_rng=graphs,
        )
        if s.cuda_graphs == "transformer_engine":
            from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

            mbs = s.micro_batch_size
            init_num_microbatches_calculator(0, None, mbs * s.grad_accum, mbs, 1)
    torch.manual_seed(s.seed)


def megatron_overrides(s: Settings, arch) -> dict[str, Any]:
    dtype = s.torch_dtype()
    o: dict[str, Any] = {"params_dtype": dtype, "bf16": dtype == torch.bfloat16}
    if on_gpu():
        if s.gpu_fusions:
            # Megatron-LM's defaults (twinkle's config mapping leaves them off for portability); not the
            # RoPE fusion on the hybrids' partial RoPE, which their flags turn off (--no-rope-fusion).
            o |= {"apply_rope_fusion": arch.hybrid is None, "bias_activation_fusion": True}
        if s.ce_fusion:
            o |= {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": s.ce_fusion_impl}
        if arch.is_moe:
            o |= {"moe_grouped_gemm": True}
            if s.gpu_fusions:
                # TE's fused token permutation, as NVIDIA's MoE recipes run (--moe-permute-fusion)
                o |= {"moe_permute_fusion": True}
        if s.cuda_graphs == "full_iteration":
            if arch.is_moe:
                raise ValueError(
                    "--cuda-graphs full_iteration captures the whole forward and backward; dropless MoE "
                    "routes a data-dependent number of tokens and cannot be captured (use "
                    "transformer_engine: megatron's partial MoE graphs)"
                )
            # Megatron-LM: --cuda-graph-impl local --cuda-graph-scope full_iteration
            o |= {
                "cuda_graph_impl": "local",
                "cuda_graph_scope": "full_iteration",
                "use_te_rng_tracker": True,
            }
        elif s.cuda_graphs != "none":
            o |= {"cuda_graph_impl": s.cuda_graphs, "use_te_rng_tracker": True}
            if arch.is_moe:
                # Dropless experts that need their token counts on the host cannot be captured; megatron's
                # partial MoE graphs take attention, router and dispatch preprocessing per layer
                # (twinkle LoRA's bf16 experts are captured whole: whole_moe_layer_graphs).
                o |= {"cuda_graph_scope": PARTIAL_MOE_SCOPE}
    return o | s.mcore_overrides


PARTIAL_MOE_SCOPE = "attn,moe_router,moe_preprocess"


def whole_moe_layer_graphs(overrides: dict[str, Any], s: Settings) -> dict[str, Any]:
    """For twinkle LoRA: TE's CUDA graphs capture the MoE layers whole (megatron's default scope) instead
    of the partial scope, unless a scope was asked for (``--set cuda_graph_scope=...``). Its bf16 grouped
    experts take the routed token counts on the GPU (``patches/moe_counts_on_device.py``: one EP/TP rank,
    dropless), so router, dispatch and experts replay with attention; FP8 experts pad per expert on the
    host and keep the partial scope, as do megatron's local graphs (not measured whole)."""
    asked = "cuda_graph_scope" in s.mcore_overrides
    te_graphs = overrides.get("cuda_graph_impl") == "transformer_engine"
    if (
        asked
        or not te_graphs
        or overrides.get("cuda_graph_scope") != PARTIAL_MOE_SCOPE
        or overrides.get("fp8")
    ):
        return overrides
    return overrides | {"cuda_graph_scope": []}


def stock_te_model(hf_dir: Path, s: Settings, overrides: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(a): megatron-core's own TE spec, same config as (b): get_gpt_layer_with_transformer_engine_spec, or
    for the hybrid models the block spec that Megatron-LM's gpt_builders builds for
    ``--experimental-attention-variant gated_delta_net`` (megatron-core's GatedDeltaNet and gated
    attention; its GDN output norm is zero-centred like the model's others, ``x * (1 + w)`` for
    transformers' ``x * w``: the same work)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from twinkle_specs.config_mapping import transformer_config_from_hf
    from twinkle_specs.hf_config import qwen_arch_from_hf
    from twinkle_specs.model import padded_vocab_size

    arch = qwen_arch_from_hf(hf_dir)
    config = transformer_config_from_hf(hf_dir, **overrides)
    if arch.hybrid is not None:
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec as block_spec,
        )

        from twinkle_specs.gdn import train_on_fla, training_rule

        spec: Any = block_spec(config=config)
        facts = {
            "spec": "get_transformer_block_with_experimental_attention_variant_spec",
            # megatron-core's GatedDeltaNet calls fla's rule (it has no other); where fla refuses its gated
            # chunk_bwd_dqkwg, the torch one that twinkle's layers use stands in, for both alike
            "gdn_rule": training_rule(on_gpu()),
        }
        train_on_fla()
    else:
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts,
            moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm,
        )
        facts = {"spec": "get_gpt_layer_with_transformer_engine_spec"}
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(arch.vocab_size, ps.get_tensor_model_parallel_world_size()),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rotary_base,
        rotary_percent=arch.hybrid.rotary_percent if arch.hybrid is not None else 1.0,
    )
    return model.cuda(torch.cuda.current_device()), facts


def _require_grad_hook(_module, _inputs, output):
    return output.requires_grad_(True) if not output.requires_grad else output


def _optimizer(s: Settings, model, config):
    """megatron-core DDP + distributed optimizer on a GPU; torch AdamW on CPU (see module doc)."""
    if not on_gpu():
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=0.01)

        def finish():
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return model, finish, "torch.optim.AdamW (CPU stand-in: megatron-core DDP buffers need CUDA)"
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    # --opt-set use_distributed_optimizer=false selects megatron's Float16Optimizer (DDP must agree).
    fields = {"use_distributed_optimizer": True, "clip_grad": 1.0} | s.optimizer_overrides
    distributed = bool(fields["use_distributed_optimizer"])
    # As Megatron-LM's get_model: DDP keeps each parameter's grad-accumulator node, which remembers the
    # stream it was made on; made on the default stream, it makes a CUDA-graph capture of the backward
    # fail ("operation would make the legacy stream depend on a capturing blocking stream").
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ddp = DistributedDataParallel(
            config=config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed
            ),
            module=model,
        )
    torch.cuda.current_stream().wait_stream(side)
    dtype = s.torch_dtype()
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=s.lr,
            weight_decay=0.01,
            adam_beta1=0.9,
            adam_beta2=0.95,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            **fields,
        ),
        [ddp],
    )

    def finish():
        ddp.finish_grad_sync()
        opt.step()
        ddp.zero_grad_buffer()
        opt.zero_grad()

    extra = "".join(
        f", {k}={v}" for k, v in s.optimizer_overrides.items() if k != "use_distributed_optimizer"
    )
    kind = "distributed Adam" if distributed else "Float16Optimizer Adam"
    return (
        ddp,
        finish,
        f"megatron-core DistributedDataParallel + get_megatron_optimizer ({kind}{extra})",
    )


def twinkle_model(
    hf_dir: Path,
    s: Settings,
    overrides: dict[str, Any],
    *,
    lora: bool = False,
    frozen: bool = False,
    timed_load: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """(b), (c), (e): ``twinkle_specs.build_model``; ``lora``: adapters on all linear layers (the base
    frozen); ``frozen``: every weight frozen (the embedding's output requires grad, so the backward still
    runs through every layer); ``timed_load``: with ``s.load``, the HF load timed (:func:`time_load`)."""
    import twinkle_specs as ts

    facts: dict[str, Any] = {}
    if lora:
        overrides = whole_moe_layer_graphs(overrides, s)
    model = ts.build_model(
        hf_dir,
        load_weights=False,
        lora=lora_config(s, hf_dir) if lora else None,
        flash_attn_4=s.flash_attn_4,
        **overrides,
    )
    if s.flash_attn_4:
        facts["attention"] = "FlashAttention-4 (twinkle_specs.flash_attention)"
    if timed_load and s.load:
        if any(hf_dir.glob("*.safetensors")):
            facts["load"] = time_load(model, hf_dir)
        else:
            facts["load_note"] = f"no safetensors checkpoint in {hf_dir}: load not measured"
    if frozen:
        for p in model.parameters():
            p.requires_grad_(False)
        model.embedding.register_forward_hook(_require_grad_hook)
    if model.config.experimental_attention_variant is not None:  # the hybrids' Gated DeltaNet layers
        from twinkle_specs.gdn import training_rule

        facts["gdn_rule"] = training_rule(on_gpu())
    return model, facts


@dataclass
class Batch:
    """One micro-batch on the device, what else the model is given, and how its loss is taken."""

    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor | None = None  # None: the mean over every position
    packed_seq_params: Any = None
    facts: dict[str, Any] = field(default_factory=dict)  # what the result says of the data

    def loss(self, per_token: torch.Tensor) -> torch.Tensor:
        if self.loss_mask is None:
            return per_token.float().mean()
        return (per_token.float() * self.loss_mask).sum() / self.loss_mask.sum()


def random_batch(vocab_size: int, s: Settings) -> Batch:
    """``micro_batch_size`` sequences of ``seq_len`` random tokens (seeded), the loss on every position."""
    dev = device()
    gen = torch.Generator().manual_seed(s.seed)
    data = torch.randint(0, vocab_size, (s.micro_batch_size, s.seq_len + 1), generator=gen).to(dev)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    position_ids = torch.arange(s.seq_len, device=dev).expand_as(tokens).contiguous()
    return Batch(tokens, labels, position_ids)


def packed_sft_batch(vocab_size: int, s: Settings) -> Batch:
    """One packed SFT row (:mod:`bench.packed_rows`) with the ``PackedSeqParams`` Megatron-LM's get_batch
    makes of it (THD, int32 ``cu_seqlens`` on the device, the longest sequence); tokens/s counts its
    conversations' tokens, not its padding."""
    from megatron.core.packed_seq_params import PackedSeqParams

    dev = device()
    row = packed_row(s.seq_len, vocab_size, s.seed)
    cu = row.cu_seqlens.to(dev)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=row.max_seqlen,
        max_seqlen_kv=row.max_seqlen,
    )
    facts = {
        "useful_tokens_per_step": row.useful_tokens,
        "answer_tokens_per_step": row.answer_tokens,
        "sequence_lengths": row.sequence_lengths,
        "data": "one packed SFT row (bench/packed_rows.py): synthetic conversations, log-normal lengths "
        "(median 450, sigma 0.75), loss on the answers only, padding to seq_len",
    }
    return Batch(
        row.tokens.to(dev),
        row.labels.to(dev),
        row.position_ids.to(dev),
        row.loss_mask.to(dev),
        params,
        facts,
    )


def prepare(
    hf_dir: Path,
    s: Settings,
    make_model: ModelFn,
    trains: bool = True,
    make_batch: Callable[[int, Settings], Batch] = random_batch,
) -> Prepared:
    """Builds one Megatron variant from ``make_model`` with its optimizer (none unless ``trains``) and
    ``make_batch``'s data, CUDA graphs captured if asked."""
    from twinkle_specs.hf_config import qwen_arch_from_hf

    init_megatron(s)
    arch = qwen_arch_from_hf(hf_dir)
    model, result = make_model(hf_dir, s, megatron_overrides(s, arch))
    config = model.config
    result["impl"] = config.transformer_impl
    import twinkle_specs

    # in this process, so for (a) too: upstream fixes that every variant shares (patches/README.md)
    result["twinkle_patches"] = [p.rpartition(".")[2] for p in twinkle_specs.patches.apply_all()]
    result["total_params"], result["trainable_params"] = count_params(model)
    result["config"] = {
        k: getattr(config, k, None)
        for k in (
            "cross_entropy_loss_fusion",
            "cross_entropy_fusion_impl",
            "apply_rope_fusion",
            "bias_activation_fusion",
            "moe_grouped_gemm",
            "moe_token_dispatcher_type",
            "moe_permute_fusion",
            "cuda_graph_impl",
        )
    }
    # what per-layer graphs capture (megatron-core 0.19: cuda_graph_modules; 0.16: cuda_graph_scope), [] the
    # whole layer; CudaGraphModule / CudaGraphScope members by name
    scope = getattr(config, "cuda_graph_modules", None)
    scope = getattr(config, "cuda_graph_scope", None) if scope is None else scope
    if result["config"]["cuda_graph_impl"] not in (None, "none") and scope is not None:
        result["config"]["cuda_graph_scope"] = [getattr(v, "name", v) for v in scope]
    if trains:
        wrapped, finish, result["optimizer"] = _optimizer(s, model, config)
        if on_gpu() and s.grad_accum > 1:
            result["unfused_grad_accumulation_ms"] = unfused_accumulation_ms(model)
    else:
        wrapped, finish, result["optimizer"] = model, (lambda: None), "none (nothing trainable)"
    model.train()
    graphs_note = (
        "not measured: CUDA graphs keep activations in their static pool" if s.cuda_graphs != "none" else None
    )

    batch = make_batch(arch.vocab_size, s)
    result |= batch.facts

    te_graphs = None
    if on_gpu() and s.cuda_graphs == "transformer_engine":
        from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

        if not hasattr(wrapped, "zero_grad_buffer"):  # (e) has no DDP: nothing for the helper to clear
            wrapped.zero_grad_buffer = lambda: None
        te_graphs = TECudaGraphHelper(
            model=[wrapped],
            config=config,
            seq_length=s.seq_len,
            micro_batch_size=s.micro_batch_size,
            optimizers=[],
        )
    local_graphs = on_gpu() and s.cuda_graphs == "local"
    if on_gpu() and s.cuda_graphs == "full_iteration":
        step = _full_iteration_step(wrapped, finish, config, batch, s)
        passes = "forward + backward" + (f" of {s.grad_accum} micro-batches" if s.grad_accum > 1 else "")
        result["step"] = f"{passes} (one CUDA graph) + optimizer step"
        return Prepared(result, step, activation_note=graphs_note)

    def forward():
        with CLOCK.phase("forward"):
            per_token = wrapped(
                batch.tokens,
                batch.position_ids,
                None,
                labels=batch.labels,
                packed_seq_params=batch.packed_seq_params,
            )
            return batch.loss(per_token)

    def backward(loss):
        with CLOCK.phase("backward"):
            (loss / s.grad_accum).backward()
        if local_graphs:
            from megatron.core.transformer.cuda_graphs import create_cudagraphs

            create_cudagraphs()

    def update():
        if not trains:  # nothing to step: the step's phases are its forward and backward only
            return
        with CLOCK.phase("optimizer"):
            finish()

    if not trains:
        passes = "forward + backward" if s.grad_accum == 1 else f"{s.grad_accum} x (forward + backward)"
        result["step"] = passes
    prepared = Prepared.accumulating(result, forward, backward, update, s.grad_accum)
    prepared.activation_note = graphs_note
    if te_graphs is not None:
        for _ in range(max(s.warmup, config.cuda_graph_warmup_steps)):
            prepared.step()
        # No cuda_graph_set_manual_hooks(): as in Megatron-LM's train(), those are DDP's param-gather
        # pre-hooks, which exist only with overlap_param_gather (DDP asserts so when one is called).
        te_graphs.create_cudagraphs()
    return prepared


def unfused_accumulation_ms(model, repeats: int = 5) -> float:
    """What gradient-accumulation fusion would save per micro-batch: megatron's DDP hook adding each
    trained weight's bf16 gradient into its fp32 ``main_grad`` (``main_grad.add_(grad)``), timed on the
    GPU (median of ``repeats``). Stock pretrain_gpt.py fuses that add into the weight-gradient GEMM only
    with apex's ``fused_weight_gradient_mlp_cuda`` (megatron's own output layer requires it), so without
    apex, as here, every micro-batch pays it."""
    params = [p for p in model.parameters() if p.requires_grad and hasattr(p, "main_grad")]
    grads = [torch.randn_like(p) for p in params]

    def accumulate() -> None:
        for p, g in zip(params, grads, strict=True):
            p.main_grad.add_(g)

    ms = median_cuda_ms(accumulate, repeats)
    for p in params:
        p.main_grad.zero_()
    return ms


def _full_iteration_step(wrapped, finish, config, batch: Batch, s: Settings):
    """A training step as Megatron-LM's train_step runs it under ``--cuda-graph-impl local
    --cuda-graph-scope full_iteration``: megatron's forward-backward schedule wrapped in its
    ``FullCudaGraphWrapper`` (eager for ``cuda_graph_warmup_steps`` iterations, then the whole forward
    and backward captured as one graph and replayed; the batch copied into static buffers each step),
    then the optimizer step outside the graph. Warmed up and captured here, before any timing."""
    import itertools

    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = {"tokens": batch.tokens, "labels": batch.labels, "position_ids": batch.position_ids}

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])

        def loss_func(output):
            loss = batch.loss(output)
            return loss, {"loss": loss.detach()}

        return out, loss_func

    forward_backward = FullCudaGraphWrapper(
        get_forward_backward_func(), cuda_graph_warmup_steps=config.cuda_graph_warmup_steps
    )

    def step():
        with CLOCK.phase("forward_backward"):
            losses = forward_backward(
                forward_step_func=forward_step,
                data_iterator=itertools.repeat(data),
                model=[wrapped],
                num_microbatches=s.grad_accum,
                seq_length=s.seq_len,
                micro_batch_size=s.micro_batch_size,
                forward_only=False,
            )
            loss = losses[0]["loss"].clone()  # the graph's output buffer is rewritten by the next replay
        with CLOCK.phase("optimizer"):
            finish()
        return loss

    for _ in range(config.cuda_graph_warmup_steps + 1):  # the last one captures
        step()
    return step


def stock_te_unavailable(hf_dir: Path, s: Settings) -> str | None:
    """Why (a) cannot run here: it needs CUDA and Transformer Engine, and for the hybrid models fla
    (megatron-core's GatedDeltaNet refuses to be built without it)."""
    if not on_gpu():
        return (
            "needs a CUDA GPU with Transformer Engine (get_gpt_layer_with_transformer_engine_spec); "
            "megatron-core's local spec is no CPU substitute either (its DotProductAttention needs CUDA)"
        )
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return "Transformer Engine is not installed"
    from twinkle_specs.hf_config import qwen_arch_from_hf

    if qwen_arch_from_hf(hf_dir).hybrid is not None:
        from megatron.core.ssm.gated_delta_net import HAVE_FLA

        if not HAVE_FLA:
            return (
                "megatron-core's GatedDeltaNet (the stock spec of the hybrid models) needs "
                "flash-linear-attention (pip install .[hybrid-gpu])"
            )
    return None


def packed_sft_unavailable(hf_dir: Path, s: Settings) -> str | None:
    """Why (g) cannot run with these settings: Megatron-LM's --sft packs one row per micro-batch,
    megatron-core's CUDA graphs take no packed_seq_params (its graph runner asserts so), and TE's packed
    attention is refused where its cuDNN trains it wrong (``twinkle_specs.packed_attention_check``: heads above
    128 on Hopper with cuDNN before 9.18; (g-fa4) runs there)."""
    if s.micro_batch_size != 1:
        return "packed SFT rows: micro-batch 1 only (as Megatron-LM's --sft)"
    if s.cuda_graphs != "none":
        return "packed SFT rows run eager: megatron-core's CUDA graphs take no packed_seq_params"
    if s.grad_accum != 1:
        return "packed SFT rows: one row per optimizer step (--grad-accum 1): its token count is the row's"
    if not s.flash_attn_4 and on_gpu():
        from twinkle_specs.hf_config import qwen_arch_from_hf
        from twinkle_specs.packed_attention_check import current_refusal

        if problem := current_refusal(qwen_arch_from_hf(hf_dir).kv_channels):
            return f"packed SFT rows on TE's attention: {problem}"
    return None


def fp8_settings(s: Settings) -> Settings:
    """``s`` with Megatron-LM's ``--fp8-format`` / ``--fp8-recipe`` (``Settings.fp8_*``) as TransformerConfig
    fields, which every Megatron variant's config takes (:func:`megatron_overrides`): megatron runs each
    transformer layer under TE's FP8 autocast, so the TE linears' GEMMs take FP8 operands (LoRA: the frozen
    base's forward and input-gradient GEMMs; the adapters stay bf16 torch GEMMs)."""
    fp8 = {"fp8": s.fp8_format, "fp8_recipe": s.fp8_recipe}
    return dataclasses.replace(s, mcore_overrides=s.mcore_overrides | fp8)


def flash_attn_4_unavailable(hf_dir: Path, s: Settings) -> str | None:
    """Why twinkle's FlashAttention-4 attention cannot run here: no CUDA GPU, or the package missing."""
    if not on_gpu():
        return "FlashAttention-4's kernels need a CUDA GPU"
    from .peer_kits import flash_attn_4_missing

    return flash_attn_4_missing()


def graphs_unavailable() -> str | None:
    """Why a variant with CUDA graphs of its own cannot run here (it would run eager, under its name)."""
    return None if on_gpu() else "CUDA graphs need a CUDA GPU"


def fp8_unavailable(hf_dir: Path, s: Settings) -> str | None:
    """Why the FP8 variants cannot run here: Transformer Engine's FP8 GEMMs need a GPU of compute
    capability 8.9 or newer (blockwise scaling: Hopper's 9.0)."""
    if not on_gpu():
        return "FP8 GEMMs need a CUDA GPU with Transformer Engine (compute capability 8.9 or newer)"
    try:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    except ImportError:
        return "Transformer Engine is not installed"
    ok, why = FP8GlobalStateManager.is_fp8_available()
    if ok and s.fp8_recipe == "blockwise":
        ok, why = FP8GlobalStateManager.is_fp8_block_scaling_available()
    return None if ok else f"Transformer Engine: {why}"


def stock_te_full(hf_dir: Path, s: Settings) -> Prepared:
    return prepare(hf_dir, s, stock_te_model)


def twinkle_full(hf_dir: Path, s: Settings) -> Prepared:
    return prepare(hf_dir, s, functools.partial(twinkle_model, timed_load=True))


def twinkle_lora(hf_dir: Path, s: Settings) -> Prepared:
    return prepare(hf_dir, s, functools.partial(twinkle_model, lora=True))


def twinkle_lora_sft(hf_dir: Path, s: Settings) -> Prepared:
    return prepare(hf_dir, s, functools.partial(twinkle_model, lora=True), make_batch=packed_sft_batch)


def twinkle_frozen(hf_dir: Path, s: Settings) -> Prepared:
    return prepare(hf_dir, s, functools.partial(twinkle_model, frozen=True), trains=False)
