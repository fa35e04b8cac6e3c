"""Clip an adapter's gradients without a host sync: the gradient norm stays on the GPU.

Upstream cause: megatron-core 0.16.x ``get_grad_norm_fp32`` ends in ``total_norm.item()``, and 0.19.x does
too unless Transformer Engine has ``multi_tensor_scale_tensor`` (newer than TE 2.11, the newest that
megatron-core 0.16.1 accepts). Every optimizer step therefore waits for the whole backward on the host,
then issues clipping, Adam and the parameter copies while the GPU sits idle, then the next forward's first
kernels. In a LoRA step the optimizer's kernels take 0.12 ms and that wait 1.3-1.6 ms of a 71 ms step
(Qwen3-8B shape on an H200).

The fix is 0.19's own device path, backported: the norm is a CUDA tensor and the gradients are multiplied
by ``min(1, max_norm / (norm + 1e-6))`` on the GPU. That multiply reads and writes every gradient even when
nothing needs clipping (the host path skips it), so it is taken only when the gradients being clipped hold
at most :data:`DEVICE_CLIP_MAX_NUMEL` elements, an adapter's optimizer: 2**29 fp32 gradients are a pass of
about 1.5 ms on an H100, below the wait it removes. That wait is the host's whole optimizer step with the
GPU idle: 13.7 ms a step with 482 M adapter parameters (Qwen3-30B-A3B, 36 layers, adapters on the routed
experts, under CUDA graphs). Larger sets (a full fine-tune) keep upstream's host path: the norm comes back
as a float, and clipping multiplies only when it clips. Their norm is still taken here, in one multi-tensor
pass and one sync: megatron-core 0.19 imports ``multi_tensor_scale_tensor`` with TE's multi-tensor kernels,
so without it (TE 2.11) and without apex it falls back to ``local_multi_tensor_l2_norm``, which turns every
gradient's norm into a Python float: a host sync per gradient tensor. Only the 2-norm, the one megatron's
optimizers use, is taken here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .gates import megatron_core_in

NEEDED_FOR = ">=0.16, <0.20 (megatron-core) on CUDA, without TE's multi_tensor_scale_tensor"

DEVICE_CLIP_MAX_NUMEL = 2**29


def is_needed() -> bool:
    if not torch.cuda.is_available() or not megatron_core_in("0.16", "0.20"):
        return False
    from megatron.core.optimizer import clip_grads

    return getattr(clip_grads, "multi_tensor_scale_tensor_impl", None) is None  # else upstream's own path


def _local_grads(grads: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
    """The local shards of (possibly DTensor) gradients, and the data-parallel group of the DTensors."""
    from megatron.core.utils import get_data_parallel_group_if_dtensor, to_local_if_dtensor

    grads = list(grads)
    dp_group = None
    for grad in grads:
        dp_group = get_data_parallel_group_if_dtensor(grad, dp_group)
    return [to_local_if_dtensor(g) for g in grads], dp_group


def get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
    """Upstream's ``get_grad_norm_fp32`` for the 2-norm: upstream's collectives in the same order, torch's
    foreach norm in place of TE's multi-tensor one (they agree to 1e-7 relative, tests/test_patches_gpu.py).
    A set of at most :data:`DEVICE_CLIP_MAX_NUMEL` elements gets its norm as a one-element tensor on the
    gradients' device (no ``.item()``); a larger one as a float, as upstream's host path returns it."""
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    grads_for_norm = list(grads_for_norm)
    if float(norm_type) != 2.0:
        from megatron.core.optimizer import clip_grads

        return clip_grads.get_grad_norm_fp32(grads_for_norm, norm_type, grad_stats_parallel_group)
    on_host = sum(g.numel() for g in grads_for_norm) > DEVICE_CLIP_MAX_NUMEL
    grads, dp_group = _local_grads(grads_for_norm)
    if grads:
        total = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum().reshape(1)
    else:  # this rank holds no gradient but still takes part in the reductions
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        total = torch.zeros(1, dtype=torch.float, device=device)
    if dp_group:
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=dp_group)
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=grad_stats_parallel_group)
    return total.sqrt().item() if on_host else total.sqrt()


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Upstream's ``clip_grad_by_total_norm_fp32``; a tensor ``total_norm`` (from
    :func:`get_grad_norm_fp32`) scales the gradients by ``min(1, max_norm / (norm + 1e-6))`` on its device."""
    if not isinstance(total_norm, torch.Tensor):
        from megatron.core.optimizer import clip_grads

        return clip_grads.clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad)
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads, _ = _local_grads(
        getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None
    )
    if grads:
        coeff = (max_norm / (total_norm + 1.0e-6)).clamp_max(1.0)
        torch._foreach_mul_(grads, coeff.reshape(()))


def apply() -> None:
    """Megatron's optimizers (``megatron/core/optimizer/optimizer.py``) call both by the names they
    imported; ``clip_grads`` keeps upstream's, which the large-set path calls."""
    from megatron.core.optimizer import optimizer

    optimizer.get_grad_norm_fp32 = get_grad_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
