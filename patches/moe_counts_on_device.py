"""The routed experts' token counts stay on the GPU where the experts take them there.

Upstream cause: megatron-core 0.16.x-0.19.x ``MoEAlltoAllTokenDispatcher`` copies each MoE layer's token
counts per expert to the host (``_maybe_dtoh_and_synchronize``) and waits for that copy before it hands
them to the experts (``d2h_event.synchronize()``), because TE's GroupedLinear plans its per-expert GEMMs on
the host. The host therefore waits for the router at every MoE layer, and the GPU then waits for the
host's next launches: on Qwen3.5-35B-A3B (20 layers, one H100, LoRA) 38 ms of a 229 ms step idle in the
forward. Experts whose GEMMs take their offsets on the device (twinkle's grouped-GEMM experts under LoRA,
``twinkle_specs.lora.experts.DeviceCounts``) need no copy.

Fix: a dispatcher whose ``counts_on_device`` is set (twinkle's LoRA sets it where the experts take the
counts there: ``twinkle_specs.lora.model.keep_routed_counts_on_device``) hands over the counts as the GPU
tensor, with no copy and no wait, where nothing else needs host values: one expert- and tensor-parallel
rank (no all-to-all split sizes) and a dropless dispatch without capacity or padding (a static output
size). Every other dispatcher runs upstream's.

So nothing in such a MoE layer waits on the host, and TE's CUDA graphs can capture it whole (megatron's
default scope: router, dispatch, experts and combine replayed with attention). Where the counts must reach
the host inside a capture, upstream fails in CUDA ("operation not permitted on an event last recorded in a
capturing stream"); the patched dispatcher refuses first and says why and what to capture instead.
"""

from __future__ import annotations

import functools

import torch

from .gates import megatron_core_in

NEEDED_FOR = ">=0.16, <0.20 (megatron-core) on CUDA"


def is_needed() -> bool:
    return torch.cuda.is_available() and megatron_core_in("0.16", "0.20")


def counts_suffice(dispatcher) -> bool:
    """Whether the token counts are all the dispatch needs from the router's output: one EP and TP rank,
    dropless, no capacity, no padding for quantization (whose output size is data-dependent)."""
    config = dispatcher.config
    return (
        dispatcher.ep_size == 1
        and dispatcher.tp_size == 1
        and not dispatcher.drop_and_pad
        and config.moe_expert_capacity_factor is None
        and not getattr(config, "moe_router_padding_for_quantization", False)
        and not getattr(config, "moe_router_padding_for_fp8", False)
    )


def leaving_counts_on_device(maybe_dtoh_and_synchronize):
    """The dispatcher's ``_maybe_dtoh_and_synchronize``, a no-op for a dispatcher asked to leave the counts
    on the GPU where :func:`counts_suffice`; upstream's otherwise, except that its wait inside a CUDA graph
    capture is refused with :func:`capture_refusal`."""

    @functools.wraps(maybe_dtoh_and_synchronize)
    def wrapper(self, point, tokens_per_expert=None):
        if getattr(self, "counts_on_device", False) and counts_suffice(self):
            return tokens_per_expert
        if capturing() and not self.drop_and_pad and point == self.cuda_sync_point:
            raise RuntimeError(capture_refusal(self))
        return maybe_dtoh_and_synchronize(self, point, tokens_per_expert)

    wrapper.leaves_counts_on_device = True
    return wrapper


def capturing() -> bool:
    """Whether the current CUDA stream is being captured (never on a host without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def capture_refusal(dispatcher) -> str:
    """Why a MoE layer being captured in a CUDA graph needs the host, and the scope that captures around it."""
    if not getattr(dispatcher, "counts_on_device", False):
        why = (
            "its routed experts need the counts on the host (only twinkle LoRA's grouped-GEMM experts take "
            "them on the GPU: --moe-grouped-gemm, bf16 experts without a bias; full fine-tuning, FP8/FP4 "
            "experts and megatron's sequential experts need host counts)"
        )
    else:
        why = (
            "the dispatch needs host values itself (expert- or tensor-parallel size above 1, "
            "--moe-expert-capacity-factor, or padding for FP8/FP4)"
        )
    return (
        "a MoE layer is being captured in a CUDA graph, but its token dispatcher must copy the routed token "
        f"counts to the host and wait for them, which a capture cannot do: {why}. Capture attention and "
        "the router only: --cuda-graph-scope attn moe_router moe_preprocess"
    )


def apply() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as dispatcher

    if not getattr(dispatcher._maybe_dtoh_and_synchronize, "leaves_counts_on_device", False):
        dispatcher._maybe_dtoh_and_synchronize = leaving_counts_on_device(
            dispatcher._maybe_dtoh_and_synchronize
        )
