"""LoRA layers that wrap megatron-core's tensor-parallel linears (portable and Transformer Engine).

Like PEFT's ``tuners/lora/layer.py``, a LoRA layer is its base layer plus ``lora_A``/``lora_B`` factors
and knows how to merge and unmerge them. Here the wrapper *is* the base class (a subclass), so the base
weight keeps its Megatron name (``...linear_qkv.weight``) for HF loading, checkpoints and export, and
the factors sit beside it. Each factor is one PEFT adapter ("slot"): a fused linear (QKV, gate/up)
holds one slot per adapted projection, so ``q_proj,v_proj`` targeting matches PEFT exactly.

One tensor per factor kind and linear, ``lora_A`` (the slots' A stacked on the rank axis) and
``lora_B`` (their B stacked on the output axis), not one per slot; a built model goes further and keeps
all of a transformer layer's dense factors in one parameter per parallel kind (:class:`LoraBank`, made
by ``prepare_lora_model``). Megatron's optimizer, DDP hooks and gradient clipping loop over parameters
in Python, and at micro-batch 1 that host time leaves the GPU idle after every step's grad-norm sync
(Qwen3-1.7B: one parameter per slot was 392 adapter tensors, per linear 224, per layer 28).
:meth:`LoraLayerMixin.lora_param` is a factor kind's tensor (the parameter, or a view of the bank),
:meth:`LoraLayerMixin.lora_factor` a slot's factor; checkpoints keep one tensor per slot
(``...linear_qkv.lora_A.q_proj``), see :meth:`LoraLayerMixin.sharded_state_dict`.

Tensor parallelism (Megatron's column/row convention):

* column-parallel base: A replicated, B sharded on its output rows like the base weight. The rank-r
  activation is all-gathered over the sequence (sequence parallel) or passed through
  copy-to-TP (identity forward, all-reduce backward), so A's gradient sums every rank's B shard.
* row-parallel base: A sharded on its input columns, B replicated. The rank-r partial sums are
  all-reduced (or reduce-scattered over the sequence), exactly like the base output.

Under sequence parallelism the replicated factor sees only this rank's tokens, so it is marked
``sequence_parallel`` and megatron's ``finalize_model_grads`` all-reduces its gradient over TP, as it
does for layer norms. Routed-expert factors carry ``allreduce = False`` (expert-parallel, like their
base weights) and need expert-tensor-parallel size 1.

Forward cost (the adapter must stay cheap next to a host-launch-bound base layer): all slots of one
linear share one A GEMM (with ``lora_A`` as it is), the ``scaling`` of the rank-sum activation (never
of the full-size output; in training the A GEMM's alpha where the slots share one scaling, else a small
multiply), one TP communication of it, and one B GEMM with a block-structured
B assembled in the fused output layout (QKV interleaved per query group, [gate; up], zero blocks for
untargeted projections) by a single gather. :meth:`LoraLayerMixin.lora_delta_per_slot` keeps the
per-slot computation as the reference. In training (:mod:`.functions`) the B GEMM accumulates into the
base output in place, the adapter's input gradient is added into the base linear's in place, and the A
GEMM keeps a recipe for its input where the module producing it is linked (:mod:`.recompute`): the
frozen base does not save that activation.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from .config import SITE_SLOTS, SlotSpec
from .fp8_amax import CastGrad, GradAmax, input_cast, tagged
from .functions import AddLowRank, Gather, GradLink, IntoBaseGrad, LowRankDown, low_rank_down
from .recompute import InputRecipe, RoutedTokens, recompute_allowed


class LoraLayerMixin:
    """Adapter factors, forward delta, merge/unmerge and sharded checkpointing for one linear.

    Subclasses set ``lora_parallel`` ("column" or "row") and call :meth:`_init_lora` after the base
    ``__init__``; ``num_gemms`` > 1 means per-expert factors stacked on dim 0 (grouped GEMM).
    """

    lora_parallel: str
    # set by prepare_lora_model where the module producing this linear's input is known (a norm before
    # linear_qkv or linear_fc1, linear_fc1 before linear_fc2): a recipe for the A GEMM's saved input
    lora_input_recipe: InputRecipe | RoutedTokens | None = None

    def _init_lora(
        self,
        *,
        input_size: int,
        output_size: int,
        site: str,
        slots: dict[str, SlotSpec],
        dropout: float,
        config: Any,
        is_expert: bool,
        num_gemms: int = 0,
        replicated: bool = False,
    ) -> None:
        self.lora_site = site
        self.lora_slots = tuple(slots)
        self.lora_spec = dict(slots)
        self.lora_merged = False
        self.lora_num_gemms = num_gemms
        self.lora_dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
        if is_expert and dropout:
            raise ValueError(
                f"LoRA on routed experts ({site}) needs lora_dropout=0 (peft's target_parameters cannot "
                "apply dropout either); set lora_dropout=0.0 or drop the expert targets"
            )
        if is_expert:
            etp = ps.get_expert_tensor_parallel_world_size() if ps.model_parallel_is_initialized() else 1
            if etp != 1:
                raise ValueError(
                    f"LoRA on routed experts ({site}) needs expert_tensor_parallel_size=1, got {etp}; "
                    "set --expert-tensor-parallel-size 1 or drop the expert targets"
                )
            self.lora_tp_size, self.lora_tp_group = 1, None
        elif replicated:  # the router: whole factors on every rank, no TP communication
            self.lora_tp_size, self.lora_tp_group = 1, ps.get_tensor_model_parallel_group()
        else:
            self.lora_tp_size = ps.get_tensor_model_parallel_world_size()
            self.lora_tp_group = ps.get_tensor_model_parallel_group()
        self.lora_sequence_parallel = bool(config.sequence_parallel) and self.lora_tp_size > 1
        self.lora_out_sizes = _slot_out_sizes(site, output_size, config)
        self.lora_banked: dict[str, tuple[LoraBank, int]] = {}  # factor kind -> (bank, member index)
        self.lora_banks: list[LoraBank] = []  # the banks this linear registers (see LoraBank)
        self.lora_A = self.lora_B = None
        if not slots:
            return
        column = self.lora_parallel == "column"
        tp, rank = self.lora_tp_size, (0 if is_expert else ps.get_tensor_model_parallel_rank())
        stack = (num_gemms,) if num_gemms else ()
        ranks = {slot: spec.r for slot, spec in slots.items()}
        rows = {slot: self.lora_out_sizes[slot] // (tp if column else 1) for slot in slots}
        starts_a, starts_b = _offsets(ranks), _offsets(rows)
        self.lora_rows = {
            slot: (
                slice(starts_a[slot], starts_a[slot] + ranks[slot]),
                slice(starts_b[slot], starts_b[slot] + n),
            )
            for slot, n in rows.items()
        }
        # Full A drawn from the default CPU generator, which megatron seeds alike on every TP rank, so
        # replicated factors agree across ranks; row-parallel ranks keep their column block.
        a = torch.empty(*stack, sum(ranks.values()), input_size)
        torch.nn.init.uniform_(a, -1 / math.sqrt(input_size), 1 / math.sqrt(input_size))
        if not column:
            a = a.chunk(tp, dim=-1)[rank]
        b = torch.zeros(*stack, sum(rows.values()), max(ranks.values()))
        device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
        self.lora_A = torch.nn.Parameter(a.to(device=device, dtype=config.params_dtype).contiguous())
        self.lora_B = torch.nn.Parameter(b.to(device=device, dtype=config.params_dtype))
        sharded, whole = (self.lora_B, self.lora_A) if column else (self.lora_A, self.lora_B)
        set_tensor_model_parallel_attributes(sharded, tp > 1, (0 if column else 1) + len(stack), 1)
        set_tensor_model_parallel_attributes(whole, False, 0, 1)
        if self.lora_sequence_parallel:
            whole.sequence_parallel = True
        if is_expert:
            for p in (sharded, whole):
                p.allreduce = False

    def lora_factor_index(self, which: str, slot: str) -> tuple:
        """Where ``slot``'s factor sits in this site's parameter ``lora_A``/``lora_B`` (after any
        expert axis): its rank rows of A; its output rows of B and, under a ``rank_pattern``, the
        first ``r`` of B's columns (a smaller slot's further columns are zeros that no GEMM reads)."""
        a_rows, b_rows = self.lora_rows[slot]
        if which == "A":
            return (..., a_rows, slice(None))
        return (..., b_rows, slice(0, self.lora_spec[slot].r))

    def lora_factor(self, which: str, slot: str) -> torch.Tensor:
        """``slot``'s factor, PEFT's ``lora_A``/``lora_B`` of that projection: a view of the site's
        parameter (all local experts stacked on dim 0 for grouped experts)."""
        return self.lora_param(which)[self.lora_factor_index(which, slot)]

    def lora_leaf(self, which: str) -> torch.nn.Parameter:
        """The parameter that holds this linear's ``lora_A``/``lora_B``: its own, or its layer's bank."""
        banked = self.lora_banked.get(which)
        return banked[0].param if banked else getattr(self, f"lora_{which}")

    def lora_view(self, which: str, t: torch.Tensor) -> torch.Tensor:
        """This linear's ``lora_A``/``lora_B`` within ``t``, a tensor shaped like :meth:`lora_leaf` (the
        parameter, its gradient, an optimizer state of it). Made afresh on every call: megatron's DDP
        moves a parameter's data into its buffers, so a view kept from before would go stale."""
        banked = self.lora_banked.get(which)
        if banked is None:
            return t
        bank, index = banked
        return t.view(-1).narrow(0, bank.offsets[index], bank.sizes[index]).view(bank.shapes[index])

    def lora_param(self, which: str) -> torch.Tensor:
        """``lora_A`` or ``lora_B`` of this linear, as the forward uses it (gradients reach the leaf);
        a banked factor is this forward's piece of its bank (:meth:`LoraBank.piece`)."""
        banked = self.lora_banked.get(which)
        if banked is None:
            return getattr(self, f"lora_{which}")
        bank, index = banked
        return bank.piece(index)

    # -- forward ---------------------------------------------------------------------------------

    def lora_hidden(
        self,
        x: torch.Tensor,
        recipe: tuple | None = None,
        link: GradLink | None = None,
        a: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``scaling * A(dropout(x))`` of all slots after the TP communication, [..., sum(r)].

        In training without dropout the A GEMM (:class:`~twinkle_specs.lora.functions.LowRankDown`)
        keeps, given ``recipe = (source, fn)`` with ``x == fn(source)``, ``source`` rather than ``x``
        (see :mod:`.recompute`), and, given a ``link``, hands its input gradient to the base's (or to
        whoever holds a deferred link). ``a``: this forward's ``lora_A`` where the caller already took it.
        """
        dropout = _dropout_active(self.lora_dropout)
        if len(self.lora_slots) > 1 and dropout:
            h = torch.cat(
                [F.linear(self.lora_dropout(x), self.lora_factor("A", s)) for s in self.lora_slots], dim=-1
            )
        elif dropout:
            h = F.linear(self.lora_dropout(x), self.lora_param("A"))
        else:
            scale = self._lora_scaling()  # the A GEMM's alpha where the slots share one
            alpha = 1.0 if scale is None else scale
            a = self.lora_param("A") if a is None else a
            if torch.is_grad_enabled():
                source, fn = recipe if recipe is not None and recompute_allowed() else (None, None)
                h = LowRankDown.apply(x, a, link, source, fn, alpha)
            else:  # the same GEMM without autograd: evaluation's h is training's, bit for bit
                h = low_rank_down(x, a, alpha)
            if scale is not None:
                return self._lora_comm(h)
        return self._lora_comm(self._lora_scale(h))

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """scaling * B(A(dropout(x))) for every slot, laid out like the base output shard.

        Fused over the slots: ``h = x @ [A_1; A_2; ...]^T`` (one GEMM: that is ``lora_A``),
        ``h * scaling`` (rank-r columns), one TP communication of ``h``, then ``h @ B^T`` with the
        block-structured B of :meth:`lora_B_fused` (one GEMM). Each output row depends on its own
        slot's rank-r block only (the other blocks of its B row are exact zeros), so this is the
        per-slot computation of :meth:`lora_delta_per_slot` up to summation order. With active
        dropout each slot keeps its own dropout mask, as PEFT's separate modules do: the A GEMMs then
        run per slot on their own dropped input (the rest stays fused).
        """
        return F.linear(self.lora_hidden(x), self.lora_B_fused())

    def lora_B_fused(self) -> torch.Tensor:
        """B of all slots in the base output layout, [output rows of this rank, sum(r)], column block
        of each slot in :attr:`lora_slots` order, zeros elsewhere (untargeted projections are zero rows).

        One gather of a cached index over [``lora_B`` flattened; a block of zeros] builds it (its
        backward is the inverse gather): two small kernels forward and one backward, whatever the slots.
        """
        b = self.lora_param("B")
        if len(SITE_SLOTS[self.lora_site]) == 1:
            return b
        layout = _fused_b_layout(self._lora_b_key(), b.device)
        flat = torch.cat([b.reshape(-1), _zeros(layout.zeros, b.dtype, b.device)])
        return Gather.apply(flat, layout.index, layout.inverse, layout.unread).view(layout.rows, layout.cols)

    def _lora_b_key(self) -> tuple:
        """What the fused-B layout depends on (hashable; shared by every layer of the same shape)."""
        tp = self.lora_tp_size if self.lora_parallel == "column" else 1
        groups = self.config.num_query_groups // tp if self.lora_site == "linear_qkv" else 1
        rows = tuple((s, self.lora_out_sizes[s] // tp) for s in SITE_SLOTS[self.lora_site])
        ranks = tuple((s, self.lora_spec[s].r) for s in self.lora_slots)
        return (self.lora_site, rows, ranks, groups)

    def _lora_scaling(self) -> float | None:
        """The scaling all slots share, else None."""
        scalings = {self.lora_spec[s].scaling for s in self.lora_slots}
        return scalings.pop() if len(scalings) == 1 else None

    def _lora_scale(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` (rank-sum columns in slot order) times each slot's scaling: one small multiply (none
        for scaling 1), a Python scalar so that bf16 activations are scaled in fp32 as before."""
        shared = self._lora_scaling()
        if shared is not None:
            return h if shared == 1.0 else h * shared
        ranks = [self.lora_spec[s].r for s in self.lora_slots]
        scalings = [self.lora_spec[s].scaling for s in self.lora_slots]
        return torch.cat([hs * c for hs, c in zip(h.split(ranks, dim=-1), scalings, strict=True)], dim=-1)

    def lora_delta_per_slot(self, x: torch.Tensor) -> torch.Tensor:
        """The unfused reference of :meth:`lora_delta`: per slot an A GEMM, a TP communication, a B
        GEMM and a full-size ``scaling`` multiply, then the fused layout with zero-filled parts (what
        the forward did before the fusion; kept for tests and bench/lora_ops.py)."""
        deltas = {}
        a, b = self.lora_param("A"), self.lora_param("B")
        for slot in self.lora_slots:
            h = F.linear(self.lora_dropout(x), a[self.lora_factor_index("A", slot)])
            h = self._lora_comm(h)
            deltas[slot] = F.linear(h, b[self.lora_factor_index("B", slot)]) * self.lora_spec[slot].scaling
        return self._lora_fuse(deltas)

    def _lora_comm(self, h: torch.Tensor) -> torch.Tensor:
        if self.lora_tp_size == 1:
            return h
        if self.lora_parallel == "column":
            if self.lora_sequence_parallel:
                return gather_from_sequence_parallel_region(h, group=self.lora_tp_group)
            return copy_to_tensor_model_parallel_region(h, group=self.lora_tp_group)
        if self.lora_sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(h, group=self.lora_tp_group)
        return reduce_from_tensor_model_parallel_region(h, group=self.lora_tp_group)

    def _lora_fuse(self, deltas: dict[str, torch.Tensor]) -> torch.Tensor:
        """Places per-slot deltas in the fused output: QKV interleaved per query group, [gate; up]."""
        slots = SITE_SLOTS[self.lora_site]
        if len(slots) == 1:
            return deltas[slots[0]]
        ref = next(iter(deltas.values()))
        tp = self.lora_tp_size
        parts = [
            deltas[s] if s in deltas else ref.new_zeros(*ref.shape[:-1], self.lora_out_sizes[s] // tp)
            for s in slots
        ]
        if self.lora_site != "linear_qkv":
            return torch.cat(parts, dim=-1)
        groups = self.config.num_query_groups // tp
        parts = [p.reshape(*p.shape[:-1], groups, -1) for p in parts]
        return torch.cat(parts, dim=-1).flatten(-2)

    def lora_active(self) -> bool:
        """Whether the forward adds the adapters (there are slots and they are not merged)."""
        return bool(self.lora_slots) and not self.lora_merged

    def _lora_add(self, out: torch.Tensor, h: torch.Tensor, out_grad: GradAmax | None = None) -> torch.Tensor:
        """``out`` plus ``h @ Bᵀ`` (``h`` from :meth:`lora_hidden`): the B GEMM accumulates into the
        base output in place (:class:`~twinkle_specs.lora.functions.AddLowRank`) where it can, else an
        out-of-place sum. ``out_grad``: what the base output's gradient passes through on its way to the
        base (see :meth:`LoraLinearMixin.forward`)."""
        b = self.lora_B_fused()
        if out.dtype == h.dtype == b.dtype and out.is_contiguous():
            return AddLowRank.apply(out, h, b, out_grad)
        if out_grad is not None:
            out = CastGrad.apply(out, out_grad)
        return out + F.linear(h, b).to(out.dtype)

    # -- merge -----------------------------------------------------------------------------------

    def lora_delta_weight(self, gemm: int | None = None) -> torch.Tensor:
        """scaling * B @ A in fp32, shaped like this rank's base weight (of expert ``gemm``)."""
        pick = (lambda t: t[gemm]) if gemm is not None else (lambda t: t)
        deltas = {
            s: pick(self.lora_factor("B", s)).float()
            @ pick(self.lora_factor("A", s)).float()
            * self.lora_spec[s].scaling
            for s in self.lora_slots
        }
        return self._lora_fuse({s: d.t() for s, d in deltas.items()}).t()

    def lora_base_weights(self) -> list[tuple[int | None, torch.nn.Parameter]]:
        if self.lora_num_gemms:
            return [(g, getattr(self, f"weight{g}")) for g in range(self.lora_num_gemms)]
        return [(None, self.weight)]

    @torch.no_grad()
    def merge(self) -> None:
        """Folds the adapters into the base weight in fp32; the exact base is kept for unmerge."""
        if not self.lora_active():
            return
        self._lora_saved = []
        for gemm, weight in self.lora_base_weights():
            self._lora_saved.append(weight.detach().clone())
            weight.copy_((weight.float() + self.lora_delta_weight(gemm)).to(weight.dtype))
        self.lora_merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Restores the base weight bit-for-bit (from the copy taken by :meth:`merge`)."""
        if not self.lora_merged:
            return
        for (_, weight), saved in zip(self.lora_base_weights(), self._lora_saved, strict=True):
            weight.copy_(saved)
        del self._lora_saved
        self.lora_merged = False

    # -- checkpointing ---------------------------------------------------------------------------

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The base's sharded state plus the factors, one ShardedTensor per slot with its own TP axis
        (B rows / A columns), under the per-slot keys ``lora_A.<slot>``/``lora_B.<slot>``.

        The base implementations treat unknown keys as replicated, which would keep only one TP rank's
        shard of B (column) or A (row); this is why the factors are described here explicitly. Each
        site parameter is a ``ShardedTensorFactory`` (the slots' blocks are cut out on save, put back
        on load), so megatron's optimizer finds the parameter itself and describes its states the same way.
        """
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if not self.lora_slots:
            return out
        dp_cp_group = (metadata or {}).get("dp_cp_group")
        factories = {}
        for which in "AB":
            if which not in self.lora_banked:
                param = self.lora_leaf(which)
                build = functools.partial(self._lora_build_sharded, which, sharded_offsets, dp_cp_group)
                merge = functools.partial(self._lora_merge_sharded, which, param.shape)
                factories[f"{prefix}lora_{which}"] = (param, build, merge)
        for bank in self.lora_banks:
            out.pop(f"{prefix}{bank.name}")  # the base listed it as a replicated tensor
            build, merge = bank.factory_functions(sharded_offsets, dp_cp_group)
            factories[f"{prefix}{bank.name}"] = (bank.param, build, merge)
        for key, (param, build, merge) in factories.items():
            # The factory carries its tensors' replica id (the same for every slot of one factor kind),
            # so that containers which rewrite replica ids (SequentialMLP: expert-DP) reach them.
            (replica_id,) = {t.replica_id for t in build(key, param, None, None).values()}
            out[key] = ShardedTensorFactory(key, param, build, merge, replica_id)
        return out

    def _lora_build_sharded(
        self, which: str, sharded_offsets: tuple, dp_cp_group, key: str, data, replica_id, flattened_range
    ) -> dict:
        """The slots' blocks of ``data`` (the factor or an optimizer state of it) as ShardedTensors, with
        the factory's ``replica_id`` where one is given."""
        if flattened_range is not None:
            raise NotImplementedError(
                f"{key}: LoRA factors in a flattened (legacy fully-sharded) optimizer checkpoint; save "
                "with --ckpt-format torch_dist and the default distributed-optimizer sharding"
            )
        views = {}
        for slot in self.lora_slots:
            block = data[self.lora_factor_index(which, slot)]
            sections = self._lora_sections(slot) if which == "B" else {}
            if not sections:
                views[f"{key}.{slot}"] = block.contiguous()
                continue
            for section, rows in zip(sections, block.split(list(sections.values()), dim=-2), strict=True):
                views[f"{key}.{slot}_{section}"] = rows.contiguous()
        if self.lora_num_gemms:
            tensors = _grouped_sharded(views, sharded_offsets)
        else:
            column = self.lora_parallel == "column"
            sharded = self.lora_tp_size > 1 and (which == "B") == column  # the router: replicated
            axes = {k: 0 if column else 1 for k in views} if sharded else {}
            tensors = make_sharded_tensors_for_checkpoint(
                views, "", axes, sharded_offsets, tp_group=self.lora_tp_group, dp_cp_group=dp_cp_group
            )
        if replica_id is not None:
            for t in tensors.values():
                t.replica_id = replica_id
        return tensors

    def _lora_merge_sharded(self, which: str, shape: torch.Size, loaded: dict) -> torch.Tensor:
        """The site tensor rebuilt from the slots' loaded blocks (the unused columns of a smaller
        rank's B are zeros, as in training)."""
        first = next(iter(loaded.values()))
        out = torch.zeros(shape, dtype=first.dtype, device=first.device)
        sections = {}
        for key, block in loaded.items():
            name = key.rsplit(".", 1)[1]
            if name in self.lora_spec:
                out[self.lora_factor_index(which, name)] = block
            else:  # one section of a slot's B (see _lora_sections)
                slot, section = name.rsplit("_", 1)
                sections.setdefault(slot, {})[section] = block
        for slot, parts in sections.items():
            out[self.lora_factor_index(which, slot)] = torch.cat(
                [parts[n] for n in self._lora_sections(slot)], -2
            )
        return out

    def _lora_sections(self, slot: str) -> dict[str, int]:
        """The sections of ``slot``'s B rows on this rank where the slot holds several TP-split parts of
        the Gated DeltaNet's in_proj (each rank has its part of each: [q; k; v] of ``in_proj_qkv``), as
        {name: local rows}; empty for a slot that is one TP-split block. Checkpointed one tensor per
        section, so the global tensors do not depend on the TP size (as megatron-core splits in_proj)."""
        if self.lora_site not in ("in_proj", "in_proj_fused"):
            return {}
        c, tp = self.config, self.lora_tp_size
        qk, v = (
            c.linear_num_key_heads * c.linear_key_head_dim,
            c.linear_num_value_heads * c.linear_value_head_dim,
        )
        nv = c.linear_num_value_heads
        parts = {
            "in_proj_qkv": {"q": qk, "k": qk, "v": v},
            "in_proj_qkvz": {"q": qk, "k": qk, "v": v, "z": v},
            "in_proj_ba": {"b": nv, "a": nv},
        }.get(slot, {})
        return {name: n // tp for name, n in parts.items()}


class LoraBank:
    """One parameter holding the factors of several linears of one transformer layer, all of one
    parallel kind (TP-sharded or not, sequence-parallel or not: the attributes megatron's gradient
    reductions and norm read per parameter). ``members`` are (module name relative to the layer,
    module, ``"A"``/``"B"``), in the bank's order; the first member registers ``param``, and
    ``owner_name`` is that member's name in the layer.

    Each member reads its factor as a piece of the bank (:meth:`piece`); the bank checkpoints as its
    members' per-slot tensors, under the keys they had on their own. ``shapes`` are the members'
    factor shapes, laid end to end in member order.
    """

    def __init__(
        self,
        name: str,
        param: torch.nn.Parameter,
        members: list[tuple[str, LoraLayerMixin, str]],
        shapes: list[tuple[int, ...]],
    ):
        self.name, self.param, self.members, self.shapes = name, param, members, shapes
        self.owner_name = members[0][0]
        self.sizes = [math.prod(shape) for shape in shapes]
        self.offsets = list(itertools.accumulate(self.sizes, initial=0))[:-1]
        self._pieces: tuple[torch.Tensor, ...] = ()
        self._made_for: tuple = ()
        # each member's place in a layer's forward (the bank keeps module order, which megatron's
        # attention registers proj first); the place of the member that took a piece last
        order = sorted(range(len(members)), key=lambda i: (_forward_place(members[i][1]), members[i][2]))
        self.forward_place = [order.index(i) for i in range(len(members))]
        self._last = -1

    def piece(self, index: int) -> torch.Tensor:
        """Member ``index``'s factor for this forward: all members' factors come from one ``split`` of
        the bank, made anew when a forward starts (a member at or before the last one taken in forward
        order, ``forward_place``: A before B, QKV, proj, router, fc1, fc2) or when the bank's storage
        or the grad mode changed (megatron's DDP moves parameters into its buffers). The gradients
        then reach the bank through one concatenation per layer and kind, not a zero-filled bank-size
        tensor per member and the sums of them (on the Qwen3-8B shape 23 small kernels per layer).
        A forward that skips members (a merged linear) still starts its own split. No forward hook
        marks the start: Transformer Engine's CUDA graphs refuse modules with hooks.
        """
        made_for, place = (self.param.data_ptr(), torch.is_grad_enabled()), self.forward_place[index]
        if place <= self._last or made_for != self._made_for:
            self._pieces = self.param.view(-1).split(self.sizes)
            self._made_for = made_for
        self._last = place
        return self._pieces[index].view(self.shapes[index])

    def factory_functions(self, sharded_offsets: tuple, dp_cp_group) -> tuple:
        """``(build, merge)`` of the bank's ``ShardedTensorFactory`` (the members share the owner's layer,
        hence its offsets). The member keys follow the factory's key at build time
        (``<layer prefix><owner name>.<bank name>``), which megatron renames when it stacks layers."""

        def build(key: str, data, replica_id, flattened_range) -> dict:
            layer_prefix = key[: len(key) - len(f"{self.owner_name}.{self.name}")]
            out = {}
            for name, module, which in self.members:
                out |= module._lora_build_sharded(
                    which,
                    sharded_offsets,
                    dp_cp_group,
                    f"{layer_prefix}{name}.lora_{which}",
                    module.lora_view(which, data),
                    replica_id,
                    flattened_range,
                )
            return out

        def merge(loaded: dict) -> torch.Tensor:
            bank = next(iter(loaded.values())).new_zeros(self.param.shape)
            for name, module, which in self.members:
                view = module.lora_view(which, bank)
                suffix = f".{name}.lora_{which}"
                mine = {k: v for k, v in loaded.items() if k.rsplit(".", 1)[0].endswith(suffix)}
                view.copy_(module._lora_merge_sharded(which, view.shape, mine))
            return bank

        return build, merge


_FORWARD_SITES = (
    "linear_qkv",
    "in_proj",
    "in_proj_fused",
    "linear_proj",
    "out_proj",
    "router",
    "linear_fc1",
    "linear_fc2",
)


def _fp8_known_amax(module: torch.nn.Module, input_: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """``x`` (``input_`` as the base takes it) as TE's FP8 tensor where the kernel that wrote ``input_``
    took its amax and TE's current scaling applies to this linear (:mod:`~twinkle_specs.lora.fp8_amax`),
    else None."""
    partials = tagged(input_)
    cast = input_cast(module) if partials is not None else None
    return cast(x, partials) if cast is not None else None


def _forward_place(module: LoraLayerMixin) -> int:
    """Where a banked linear runs in its layer's forward (attention, router, MLP or shared expert)."""
    site = module.lora_site
    return _FORWARD_SITES.index(site) if site in _FORWARD_SITES else len(_FORWARD_SITES)


def _dropout_active(dropout: torch.nn.Module) -> bool:
    return isinstance(dropout, torch.nn.Dropout) and dropout.training and dropout.p > 0


class _BLayout:
    """Where each element of the fused B comes from: ``index`` (int32, on the device) into
    [``lora_B`` flattened; ``zeros`` zeros], and ``inverse``, for each of those its fused position.

    ``lora_B`` holds the targeted slots' row blocks in slot order, as wide as the largest rank; a slot
    of a smaller rank (``rank_pattern``) uses its first ``r`` columns. The rest is never read, so it
    gets no gradient and stays zero (``unread``).
    """

    def __init__(self, key: tuple):
        _site, rows, ranks, groups = key
        rank, width = dict(ranks), max(r for _, r in ranks)
        col0, row0, cols, nrows = {}, {}, 0, 0
        for slot, r in ranks:  # slot order: its column block in the fused B, its rows in lora_B
            col0[slot], row0[slot] = cols, nrows
            cols, nrows = cols + r, nrows + dict(rows)[slot]
        parts = []
        for slot, n in rows:  # output row blocks in the site's order
            block = torch.full((n, cols), -1, dtype=torch.int64)
            if slot in rank:
                r, src_rows = rank[slot], row0[slot] + torch.arange(n)
                block[:, col0[slot] : col0[slot] + r] = src_rows.view(n, 1) * width + torch.arange(r)
            parts.append(block.view(groups, n // groups, cols))
        index = torch.cat(parts, dim=1).view(-1, cols)  # QKV: [q; k; v] of each query group in turn
        zero = index < 0
        index[zero] = nrows * width + torch.arange(int(zero.sum()))
        self.rows, self.cols, self.zeros = index.shape[0], cols, int(zero.sum())
        self.index = index.view(-1)
        size = self.index.numel()
        self.inverse = torch.full((nrows * width + self.zeros,), size, dtype=torch.int64)
        self.inverse[self.index] = torch.arange(size)
        self.unread = bool((self.inverse == size).any())


@functools.cache
def _fused_b_layout(key: tuple, device: torch.device) -> _BLayout:
    """The fused-B layout of ``key`` (see :meth:`LoraLayerMixin._lora_b_key`) with its index tensors
    on ``device``; one per distinct layer shape, shared by all layers of that shape."""
    layout = _BLayout(key)
    layout.index = layout.index.to(device=device, dtype=torch.int32)
    layout.inverse = layout.inverse.to(device=device, dtype=torch.int32)
    return layout


@functools.cache
def _zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A constant block of ``n`` zeros (never written: it only feeds the fused-B gather)."""
    return torch.zeros(n, dtype=dtype, device=device)


def _grouped_sharded(factors: dict, sharded_offsets: tuple) -> dict:
    """Grouped-GEMM factors, [local experts, ...] each: this rank's block of the global expert axis
    (expert-tensor-parallel size is 1, so there is no TP axis), replicated over expert-DP."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    ep_rank = ps.get_expert_model_parallel_rank()
    ep_size = ps.get_expert_model_parallel_world_size()
    return {
        key: ShardedTensor.from_rank_offsets(
            key,
            t,
            *sharded_offsets,
            (len(sharded_offsets), ep_rank, ep_size),
            replica_id=(0, 0, ps.get_expert_data_parallel_rank()),
            prepend_axis_num=len(sharded_offsets),
        )
        for key, t in factors.items()
    }


def _offsets(sizes: dict[str, int]) -> dict[str, int]:
    """Where each block starts when the blocks of ``sizes`` are laid end to end in dict order."""
    return dict(zip(sizes, itertools.accumulate(sizes.values(), initial=0), strict=False))


def _slot_out_sizes(site: str, output_size: int, config: Any) -> dict[str, int]:
    """Global output rows of every slot of ``site`` (QKV from the head counts, gate/up halves, the Gated
    DeltaNet's projections from its head counts). A gated attention's ``q_proj`` holds the gates too."""
    if site == "linear_qkv":
        d = config.kv_channels
        sizes = {"q_proj": config.num_attention_heads * d * (2 if config.attention_output_gate else 1)}
        sizes |= {"k_proj": config.num_query_groups * d, "v_proj": config.num_query_groups * d}
    elif site == "linear_fc1":
        sizes = {"gate_proj": output_size // 2, "up_proj": output_size // 2}
    elif site in ("in_proj", "in_proj_fused"):
        qk = config.linear_num_key_heads * config.linear_key_head_dim
        v, nv = config.linear_num_value_heads * config.linear_value_head_dim, config.linear_num_value_heads
        if site == "in_proj":
            sizes = {"in_proj_qkv": 2 * qk + v, "in_proj_z": v, "in_proj_b": nv, "in_proj_a": nv}
        else:
            sizes = {"in_proj_qkvz": 2 * qk + 2 * v, "in_proj_ba": 2 * nv}
    else:
        sizes = {SITE_SLOTS[site][0]: output_size}  # single-slot sites, the router's ``gate`` too
    if sum(sizes.values()) != output_size:
        raise ValueError(f"LoRA {site}: slot sizes {sizes} do not add up to the linear's {output_size} rows")
    return sizes


class LoraLinearMixin(LoraLayerMixin):
    """A (portable or TE) linear returning ``(out, bias)`` with the adapters added to ``out``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        lora_site: str,
        lora_slots: dict,
        lora_dropout: float,
        **kwargs: Any,
    ):
        super().__init__(input_size, output_size, **kwargs)
        self._init_lora(
            input_size=input_size,
            output_size=output_size,
            site=lora_site,
            slots=lora_slots,
            dropout=lora_dropout,
            config=kwargs["config"],
            is_expert=kwargs.get("is_expert", False),
        )

    def forward(self, input_: torch.Tensor, *args: Any, lora_out_grad: GradAmax | None = None, **kwargs: Any):
        """``(out, bias)``; ``lora_out_grad``: a :class:`~twinkle_specs.lora.fp8_amax.GradAmax` that the
        base output's gradient passes through (the consumer's kernel took its amax)."""
        if not self.lora_active():
            if self.lora_input_recipe:
                self.lora_input_recipe.drop()
            out, bias = super().forward(input_, *args, **kwargs)
            return (out if lora_out_grad is None else CastGrad.apply(out, lora_out_grad)), bias
        out, bias, h = self.lora_base_and_hidden(input_, *args, **kwargs)
        return self._lora_add(out, h, lora_out_grad), bias

    def lora_base_and_hidden(
        self,
        input_: torch.Tensor,
        *args: Any,
        lora_link: GradLink | None = None,
        lora_a: torch.Tensor | None = None,
        lora_base_input: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple:
        """The base's ``(out, bias)`` and the adapter's ``h`` (:meth:`lora_hidden`), not yet added: for a
        consumer that applies ``h @ Bᵀ`` itself (:class:`~twinkle_specs.lora.mlp.LoraMLP`). A caller
        that takes over this linear's input gradient passes its deferred ``lora_link`` and the
        ``lora_a`` it uses, and may give the base the same input in another form (``lora_base_input``:
        TE's FP8 tensor of it, :mod:`~twinkle_specs.lora.fp8_amax`)."""
        recipe = self.lora_input_recipe.take(input_) if self.lora_input_recipe else None
        link, x = lora_link, input_
        if link is None and self.lora_links_grad(input_):
            # The base and the A GEMM share one input gradient: the adapter's is added into the base's
            # dgrad in place (functions.IntoBaseGrad), not summed by autograd.
            link = GradLink()
            x = IntoBaseGrad.apply(input_, link)
        if lora_base_input is not None and lora_link is None:
            raise ValueError("lora_base_input needs the caller's lora_link: the base's input gradient is its")
        if lora_base_input is None:
            lora_base_input = _fp8_known_amax(self, input_, x)
        out, bias = super().forward(x if lora_base_input is None else lora_base_input, *args, **kwargs)
        return out, bias, self.lora_hidden(x, recipe, link, lora_a)

    def lora_links_grad(self, input_: torch.Tensor) -> bool:
        """Whether this forward's adapter input gradient can be handed over (training without
        dropout, an input that needs a gradient)."""
        return torch.is_grad_enabled() and input_.requires_grad and not _dropout_active(self.lora_dropout)


class LoraColumnParallelLinear(LoraLinearMixin, ColumnParallelLinear):
    """Portable ColumnParallelLinear (linear_qkv, linear_fc1) with LoRA."""

    lora_parallel = "column"


class LoraRowParallelLinear(LoraLinearMixin, RowParallelLinear):
    """Portable RowParallelLinear (linear_proj, linear_fc2) with LoRA."""

    lora_parallel = "row"


class LoraTopKRouter(LoraLayerMixin, TopKRouter):
    """The MoE router with a LoRA on its logits (peft's ``target_parameters=["mlp.gate.weight"]``).

    The router weight is replicated over TP, so are both factors; under sequence parallelism each rank
    routes its own tokens, so both factors are marked ``sequence_parallel`` like the router weight.
    """

    lora_parallel = "column"

    def __init__(self, *args: Any, lora_site: str, lora_slots: dict, lora_dropout: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._init_lora(
            input_size=self.config.hidden_size,
            output_size=self.config.num_moe_experts,
            site=lora_site,
            slots=lora_slots,
            dropout=lora_dropout,
            config=self.config,
            is_expert=False,
            replicated=True,
        )
        for factor in (self.lora_A, self.lora_B):
            factor.sequence_parallel = self.config.sequence_parallel

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        logits = super().gating(input)
        return self._lora_add(logits, self.lora_hidden(input)) if self.lora_active() else logits
