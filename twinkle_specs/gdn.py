"""Gated DeltaNet (the linear-attention layer of Qwen3-Next / Qwen3.5) that also runs without a GPU.

megatron-core's :class:`~megatron.core.ssm.gated_delta_net.GatedDeltaNet` refuses to exist without
``flash-linear-attention`` and places its parameters on CUDA. :class:`PortableGatedDeltaNet` keeps its
parameters, their layout (``in_proj`` rows [q; k; v; z; beta; alpha] of this TP rank, ``conv1d`` over
[q; k; v], ``dt_bias``, ``A_log``, ``out_norm``, ``out_proj``), its distributed-checkpoint sharding and
its gated output norm, and chooses the kernels per call: fla's chunked gated delta rule and
``causal-conv1d`` on CUDA tensors when they are installed (where fla refuses one kernel of its own
backward, :func:`fla_backward_refused`, that kernel runs in torch: :mod:`twinkle_specs.gdn_dqkwg`),
otherwise megatron-core's torch reference of the chunked rule and a depthwise ``conv1d`` (the portable
path, as the SDPA core attention is for attention). The output norm multiplies by ``w`` (not ``1 + w``),
as transformers' ``RMSNormGated`` does, whatever ``layernorm_zero_centered_gamma`` says for the model's
other norms. Under context parallelism the layer trades sequence chunks for heads around its token mixing
(:mod:`twinkle_specs.gdn_cp`).
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule as torch_chunk_rule
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from twinkle_specs import gdn_conv, gdn_cp
from twinkle_specs.packed_sequences import PackedRow


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's (and transformers') L2 normalisation of q and k, in fp32."""
    x32 = x.float()
    return (x32 * torch.rsqrt((x32 * x32).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _fla_rule(needs_grad: bool):
    """fla's chunked gated delta rule, or None for the torch reference (fla is not installed). Where fla
    refuses its gated ``chunk_bwd_dqkwg`` (:func:`fla_backward_refused`), a training call first gives fla
    the torch one of :mod:`twinkle_specs.gdn_dqkwg`."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    if needs_grad:
        train_on_fla()
    return chunk_gated_delta_rule


def train_on_fla() -> None:
    """Where fla refuses its gated ``chunk_bwd_dqkwg`` (:func:`fla_backward_refused`), give fla the torch one
    of :mod:`twinkle_specs.gdn_dqkwg` (once per process, with one warning), so that fla's rule trains here;
    elsewhere nothing. Any Gated DeltaNet that calls fla's rule in this process gains it (the benchmark's
    megatron-core and transformers peers too)."""
    if why := fla_backward_refused():
        from twinkle_specs import gdn_dqkwg

        gdn_dqkwg.enable()
        _warn_once(
            f"{why}: that kernel (chunk_bwd_dqkwg) runs in torch (twinkle_specs.gdn_dqkwg), "
            f"the rest of the rule on fla's kernels. Install tilelang (or Triton >= 3.7.1) for fla's own."
        )


@functools.cache
def fla_backward_refused() -> str | None:
    """Why fla's gated delta rule cannot train here, else None. fla 0.6 raises in the backward (at the
    first training step, after the forward has run) on Hopper GPUs with Triton >= 3.4 and < 3.7.1 unless
    tilelang is installed, because Triton miscompiles that kernel there; torch 2.11 ships Triton 3.6."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    if not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1):
        return None
    if importlib.util.find_spec("tilelang") is not None:
        return None  # fla dispatches that kernel to its tilelang backend
    import triton

    return (
        f"flash-linear-attention refuses the Gated DeltaNet backward on this Hopper GPU with Triton "
        f"{triton.__version__} (wrong results below Triton 3.7.1)"
    )


def training_rule(on_cuda: bool) -> str:
    """Which chunked gated delta rule a training step of these layers runs here, and why (for reports:
    the torch reference is correct but far slower than fla's kernels)."""
    if not on_cuda:
        return "torch reference (host tensors)"
    if importlib.util.find_spec("fla") is None:
        return "torch reference (flash-linear-attention is not installed)"
    if why := fla_backward_refused():
        return f"fla chunk_gated_delta_rule, chunk_bwd_dqkwg in torch (twinkle_specs.gdn_dqkwg: {why})"
    return "fla chunk_gated_delta_rule"


@functools.cache
def _warn_once(message: str) -> None:
    logging.getLogger(__name__).warning(message)


@functools.cache  # a failed import is retried on every call otherwise (tens of µs per layer and forward)
def _causal_conv1d():
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError:
        return None
    return causal_conv1d_fn


class PlainRMSNorm(torch.nn.Module):
    """``x / rms(x) * w`` in fp32 (the GDN output norm: never zero-centred)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(
            x.dtype
        )


# Context parallelism exchanges sequence chunks for heads (:mod:`.gdn_cp`): whole rows only (packed SFT rows
# are partitioned differently), and every rank needs whole key and value heads.
CP_PACKED_ROWS = (
    "--context-parallel-size > 1 with packed sequences (--sft) on Gated DeltaNet layers (Qwen3-Next / Qwen3.5 "
    "linear_attention layers): not supported; run --sft with --context-parallel-size 1 (split the model with "
    "--tensor-model-parallel-size / --pipeline-model-parallel-size)"
)


def context_parallel_problem(
    cp: int, tp: int, num_key_heads: int, num_value_heads: int, packed: bool = False
) -> str | None:
    """Why a Gated DeltaNet layer cannot run at context parallel ``cp`` (None: it can)."""
    if cp == 1:
        return None
    if packed:
        return CP_PACKED_ROWS
    if (num_key_heads // tp) % cp or (num_value_heads // tp) % cp:
        return (
            f"--context-parallel-size {cp} with --tensor-model-parallel-size {tp}: each context-parallel rank "
            f"runs whole Gated DeltaNet heads, so CP x TP must divide the key heads ({num_key_heads}, "
            f"linear_num_key_heads) and the value heads ({num_value_heads}, linear_num_value_heads)"
        )
    return None


class PortableGatedDeltaNet(GatedDeltaNet):
    """megatron-core's GatedDeltaNet with device-independent construction and kernels (module docstring)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: GatedDeltaNetSubmodules,
        layer_number: int | None = None,
        pg_collection=None,
        **_: object,
    ) -> None:
        MegatronModule.__init__(self, config)
        problem = context_parallel_problem(
            config.context_parallel_size,
            config.tensor_model_parallel_size,
            config.linear_num_key_heads,
            config.linear_num_value_heads,
        )
        if problem:
            raise ValueError(problem)
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.layer_number, self.pg_collection = layer_number, pg_collection
        self.bias, self.conv_bias, self.use_qk_l2norm = False, False, True
        self.tp_size = pg_collection.tp.size()
        self.sp_size = self.tp_size if config.sequence_parallel else 1
        self.hidden_size = config.hidden_size
        self.act_fn = config.activation_func
        self.activation = self.act_fn.__name__
        self.conv_kernel_dim = config.linear_conv_kernel_dim
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.num_key_heads, self.num_value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.qk_dim = self.key_head_dim * self.num_key_heads
        self.v_dim = self.value_head_dim * self.num_value_heads
        self.in_proj_dim = self.qk_dim * 2 + self.v_dim * 2 + self.num_value_heads * 2
        self.in_proj = build_module(
            submodules.in_proj,
            self.hidden_size,
            self.in_proj_dim,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="fc1",
            tp_group=pg_collection.tp,
        )
        self.conv_dim = self.qk_dim * 2 + self.v_dim
        self.conv_dim_local_tp = self.conv_dim // self.tp_size
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.conv1d = torch.nn.Conv1d(
            self.conv_dim_local_tp,
            self.conv_dim_local_tp,
            bias=False,
            kernel_size=self.conv_kernel_dim,
            groups=self.conv_dim_local_tp,
            padding=self.conv_kernel_dim - 1,
            device=device,
            dtype=config.params_dtype,
        )
        self.num_v_heads_local_tp = self.num_value_heads // self.tp_size
        # megatron-core 0.19's sharded_state_dict splits in_proj's rows by these (0.16 by its own sizes).
        self.qk_dim_local_tp, self.v_dim_local_tp = self.qk_dim // self.tp_size, self.v_dim // self.tp_size
        self.in_proj_split_names = ["query", "key", "value", "z", "beta", "alpha"]
        self.in_proj_split_sections = (
            self.qk_dim_local_tp,
            self.qk_dim_local_tp,
            self.v_dim_local_tp,
            self.v_dim_local_tp,
            self.num_v_heads_local_tp,
            self.num_v_heads_local_tp,
        )
        self.dt_bias = torch.nn.Parameter(
            torch.ones(self.num_v_heads_local_tp, dtype=config.params_dtype, device=device)
        )
        self.A_log = torch.nn.Parameter(
            torch.zeros(self.num_v_heads_local_tp, dtype=config.params_dtype, device=device)
        )
        for p in (self.conv1d.weight, self.dt_bias, self.A_log):
            p.tensor_model_parallel = True
            p.partition_dim = 0
        self.cp_size = config.context_parallel_size
        # Context parallel: in_proj's features in blocks of each rank's heads, and the rows of the per-head
        # parameters (the convolution's channels, A_log, dt_bias) that this rank's heads use.
        self._cp_order = self._cp_conv_rows = self._cp_head_rows = None
        if self.cp_size > 1:
            cp_rank = pg_collection.cp.rank()
            self._cp_order = gdn_cp.head_order(self.in_proj_split_sections, self.cp_size, device)
            conv = (self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp)
            self._cp_conv_rows = gdn_cp.local_rows(conv, self.cp_size, cp_rank, device)
            self._cp_head_rows = gdn_cp.local_rows(
                (self.num_v_heads_local_tp,), self.cp_size, cp_rank, device
            )
        self.out_norm = build_module(
            submodules.out_norm, config=config, hidden_size=self.value_head_dim, eps=config.layernorm_epsilon
        )
        self.out_proj = build_module(
            submodules.out_proj,
            self.v_dim,
            self.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="fc2",
            tp_group=pg_collection.tp,
        )

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None, **kwargs):
        """[s, b, h] -> ([s, b, h], None). Causal by construction: the attention mask is not used. Packed
        sequences (THD, ``cu_seqlens``) restart the convolution and the recurrence at each sequence, from a
        zero state, as each sequence alone would."""
        if kwargs.get("inference_context") is not None:
            raise NotImplementedError("Gated DeltaNet: inference is not supported")
        qkvzba, _ = self.in_proj(hidden_states)
        if self.cp_size > 1:  # this rank's chunks, all heads -> the whole sequence, this rank's heads
            if packed_seq_params is not None:
                raise ValueError(CP_PACKED_ROWS)
            qkvzba = gdn_cp.sequence_to_heads(qkvzba.index_select(-1, self._cp_order), self.pg_collection.cp)
        qkvzba = qkvzba.transpose(0, 1)  # [b, s, x]
        row = None if packed_seq_params is None else packed_row(packed_seq_params, qkvzba)
        out = self._mix(qkvzba, row).transpose(0, 1)
        if self.cp_size > 1:
            out = gdn_cp.heads_to_sequence(out, self.pg_collection.cp)
        return self.out_proj(out.contiguous())

    @staticmethod
    def _rows(param: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """``param``'s ``rows`` (this context-parallel rank's heads), all of it where ``rows`` is None."""
        return param if rows is None else param.index_select(0, rows)

    def _mix(self, qkvzba: torch.Tensor, row: PackedRow | None = None) -> torch.Tensor:
        """The token mixing: in_proj's output [b, s, x] -> [b, s, v], over whole sequences, or over the
        packed sequences of ``row`` (micro-batch 1)."""
        batch, seq_len = qkvzba.shape[:2]
        query, key, value, gate, beta, alpha = self._split_conv(qkvzba, row)
        query = query.reshape(batch, seq_len, -1, self.key_head_dim)
        key = key.reshape(batch, seq_len, -1, self.key_head_dim)
        value = value.reshape(batch, seq_len, -1, self.value_head_dim)
        a_log, dt_bias = (self._rows(p, self._cp_head_rows) for p in (self.A_log, self.dt_bias))
        g = -a_log.float().exp() * F.softplus(alpha.float() + dt_bias)
        beta = beta.sigmoid()
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, g, beta))
        rule = _fla_rule(needs_grad) if query.is_cuda and not self.config.deterministic_mode else None
        if rule is not None:  # fla's varlen rule takes the packed sequences in one call
            # q and k at their own head count: fla maps value head i to key head i // (value / key heads),
            # as transformers' repeat_interleave does, and sums their gradients over each group itself
            out, _ = rule(
                query.contiguous(),
                key.contiguous(),
                value.contiguous(),
                g=g,
                beta=beta,
                use_qk_l2norm_in_kernel=True,
                cu_seqlens=None if row is None else row.cu_seqlens,
                cu_seqlens_cpu=None if row is None else row.cu_seqlens_cpu,
            )
        else:
            repeat = self.num_value_heads // self.num_key_heads
            if repeat > 1:
                query, key = (t.repeat_interleave(repeat, dim=2) for t in (query, key))
            query, key = l2norm(query).contiguous(), l2norm(key).contiguous()
            value, beta = value.contiguous(), beta.contiguous()
            out = torch.cat(
                [
                    torch_chunk_rule(
                        query[:, a:b], key[:, a:b], value[:, a:b], g=g[:, a:b], beta=beta[:, a:b]
                    )[0]
                    for a, b in (row.spans if row else [(0, seq_len)])
                ],
                dim=1,
            )
        out = self._apply_gated_norm(out, gate.reshape(batch, seq_len, -1, self.value_head_dim))
        return out.reshape(batch, seq_len, -1)

    def _split_conv(self, qkvzba: torch.Tensor, row: PackedRow | None) -> tuple[torch.Tensor, ...]:
        """in_proj's output [b, s, x] -> q, k, v (after the short convolution and its activation, each
        packed sequence from its own start), z, beta, alpha, each [b, s, its width]. On CUDA without
        causal-conv1d, :mod:`twinkle_specs.gdn_conv` does the split and the convolution in one: q, k and v
        come out contiguous, and the backward writes every part's gradient into one gradient of in_proj's
        output (no copies, no concatenation)."""
        split = self.tp_size * self.cp_size
        qk, v, heads = self.qk_dim // split, self.v_dim // split, self.num_value_heads // split
        weight = self._rows(self.conv1d.weight.squeeze(1), self._cp_conv_rows)  # [channels, kernel]
        causal_conv1d = _causal_conv1d() if qkvzba.is_cuda and not self.config.deterministic_mode else None
        if causal_conv1d is None and gdn_conv.usable(qkvzba, weight, self.activation):
            starts = None if row is None else row.starts
            return gdn_conv.split_conv_silu(qkvzba, weight, (qk, qk, v, v, heads, heads), starts)
        qkv, gate, beta, alpha = torch.split(qkvzba, [2 * qk + v, v, heads, heads], dim=-1)
        conv = self._conv(qkv, weight, row, causal_conv1d)
        return (*torch.split(conv, [qk, qk, v], dim=-1), gate, beta, alpha)

    def _conv(
        self, qkv: torch.Tensor, weight: torch.Tensor, row: PackedRow | None, causal_conv1d
    ) -> torch.Tensor:
        """The short convolution (``weight`` [channels, kernel]) with its activation, [b, s, d] -> [b, s, d],
        each packed sequence from its own start: ``causal_conv1d`` (causal-conv1d's function, where installed
        and on CUDA), else torch's depthwise ``conv1d``, over a [b, d, s] copy."""
        x = qkv.transpose(1, 2).contiguous()  # [b, d, s]
        if row is not None:  # (kernel - 1) zeros before each sequence: one convolution restarts at each
            places = row.places(self.conv_kernel_dim - 1)
            wide = x.shape[-1] + len(row.spans) * (self.conv_kernel_dim - 1)
            x = x.new_zeros(*x.shape[:2], wide).index_copy(2, places, x)
        if causal_conv1d is None:  # self.conv1d's own computation, with this rank's channels
            full = F.conv1d(x, weight.unsqueeze(1), padding=self.conv_kernel_dim - 1, groups=weight.shape[0])
            x = self.act_fn(full[..., : x.shape[-1]])
        else:
            x = causal_conv1d(x=x, weight=weight, bias=None, activation=self.activation)
        if row is not None:
            x = x.index_select(2, places)
        return x.transpose(1, 2)

    def _apply_gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """megatron-core's gated norm; compiled (its ``jit_fuser``) only on CUDA, where compiling pays."""
        if x.is_cuda:
            return GatedDeltaNet._apply_gated_norm(self, x, gate)
        y = self.out_norm(x.reshape(-1, x.shape[-1]))
        return (y * self.act_fn(gate.reshape(-1, gate.shape[-1]).float())).to(x.dtype)

    def reset_parameters(self) -> None:
        """Weights come from the checkpoint; the random init of megatron-core's module needs CUDA."""


def packed_row(params, qkvzba: torch.Tensor) -> PackedRow:
    """The packed sequences of in_proj's output [1, s, x] (micro-batch 1, THD), shared by the layers of one
    micro-batch."""
    if params.qkv_format != "thd" or qkvzba.shape[0] != 1:
        raise NotImplementedError("Gated DeltaNet takes packed sequences in THD format (micro-batch 1) only")
    return PackedRow.of(params, qkvzba.shape[1], qkvzba.device)
