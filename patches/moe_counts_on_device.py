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


def dispatch_host_reason(dispatcher) -> str | None:
    """What makes the dispatch itself need host values (the setting to change), or None where the token
    counts are all it needs from the router's output: one EP and TP rank, dropless, no capacity, no padding
    for quantization (whose output size is data-dependent). Called at each of the dispatcher's copy points
    (:func:`counts_suffice`), so the reasons are constant strings, formatted nowhere."""
    config = dispatcher.config
    for needed, reason in (
        (dispatcher.ep_size != 1, "expert-parallel size above 1: the all-to-all's split sizes"),
        (dispatcher.tp_size != 1, "expert tensor-parallel size above 1"),
        (dispatcher.drop_and_pad, "--moe-pad-expert-input-to-capacity"),
        (config.moe_expert_capacity_factor is not None, "--moe-expert-capacity-factor"),
        (
            getattr(config, "moe_router_padding_for_quantization", False),
            "--moe-router-padding-for-quantization",
        ),
        (getattr(config, "moe_router_padding_for_fp8", False), "--moe-router-padding-for-fp8"),
    ):
        if needed:
            return reason
    return None


def counts_suffice(dispatcher) -> bool:
    """Whether the token counts are all the dispatch needs (:func:`dispatch_host_reason` finds nothing)."""
    return dispatch_host_reason(dispatcher) is None


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
    """Why a MoE layer being captured in a CUDA graph needs the host (what the experts or the dispatch
    found, :func:`dispatch_host_reason`), and the scope that captures around it."""
    if getattr(dispatcher, "counts_on_device", False):
        why = f"the dispatch needs host values itself ({dispatch_host_reason(dispatcher)})"
    else:
        reason = getattr(dispatcher, "host_counts_reason", None) or (
            "only twinkle LoRA's grouped-GEMM experts take them on the GPU: full fine-tuning and megatron's "
            "sequential experts (no --moe-grouped-gemm) take them on the host"
        )
        why = f"its routed experts need the counts on the host ({reason})"
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
