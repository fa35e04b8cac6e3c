"""Model FLOPs of one training step, aware of which weights are trained (see docs/benchmarks.md).

Counts matrix multiplications only (norms, activations, rotary, softmax, the Gated DeltaNet's causal
conv1d and the optimizer are left out), with multiply-add = 2 FLOPs, and no recomputation (flash
attention's backward recompute is not model work). For T tokens in sequences of lengths S_i (sum T):

    N      = matmul weights one token passes through: per full-attention layer q, k, v, o (the hybrid
             models' gated attention: q twice as wide, queries and output gate), per Gated DeltaNet layer
             in_proj (q, k, v, z, b, a: h * (2 * n_k * d_k + 2 * n_v * d_v + 2 * n_v)) and out_proj
             (n_v * d_v * h); per layer the MLP (MoE: router, top-k routed experts, shared expert and its
             gate); plus the output layer h * V
    A      = causal attention scores and weighted sum, forward, on the full-attention layers:
             2 * L_full * n_heads * head_dim * sum_i S_i^2 (4 * S * n_heads * head_dim per token and
             layer, halved by the causal mask; each packed sequence attends within itself)
    D      = chunked gated delta rule, forward, on the Gated DeltaNet layers: 2 * L_lin * 4 * n_v * d_k *
             d_v * T (per token, layer and value head 4 * d_k * d_v multiply-adds: K K^T, V K^T,
             S (a (I - b K K^T)) and S Q, as Megatron-LM core_v0.19's num_floating_point_operations counts
             it, there with d_k = d_v)
    N_lora = adapter weights one token passes through: per adapted projection r * (d_in + d_out),
             routed-expert adapters counted top-k times, each on the layers that have its projection

    full fine-tune : 6 * N * T + 3 * (A + D)                       (forward, input and weight gradient)
    LoRA           : 4 * N * T + 6 * N_lora * T + 3 * (A + D)      (frozen weights need no weight gradient)
    frozen base    : 4 * N * T + 3 * (A + D)                       (forward and backward, nothing trained)

The same count is used for the Megatron and the Hugging Face runs of a shape, so MFU compares work
done per second, not implementation choices. T counts a packed row's conversations, not its padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no runtime import: the parent process of bench/run.py must not pull in TE/CUDA
    from twinkle_specs.hf_config import QwenArch
    from twinkle_specs.lora import LoraConfig

# Dense bf16 tensor-core peak, FLOP/s, by device-name substring (first match wins; most specific first).
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989.4e12),
    ("H200", 989.4e12),
    ("H800", 989.4e12),
    ("GH200", 989.4e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
)


def peak_flops(device_name: str | None) -> float | None:
    """Dense bf16 peak of a GPU from its name, or None when unknown (then MFU is not reported)."""
    if not device_name:
        return None
    for key, value in PEAK_BF16_FLOPS:
        if key in device_name:
            return value
    return None


def _layer_types(a: QwenArch) -> tuple[str, ...]:
    """Each layer's token mixer: full_attention, or linear_attention (Gated DeltaNet) in hybrid models."""
    return a.hybrid.layer_types if a.hybrid is not None else ("full_attention",) * a.num_layers


def _attention_dims(a: QwenArch) -> tuple[int, int, int]:
    """(query width incl. the hybrids' output gate, query heads x head_dim, key/value width)."""
    q = a.num_attention_heads * a.kv_channels
    return q * (2 if a.hybrid is not None else 1), q, a.num_query_groups * a.kv_channels


def _linear_attention_dims(a: QwenArch) -> tuple[int, int, int]:
    """(n_k * d_k, n_v * d_v, n_v) of a Gated DeltaNet layer."""
    h = a.hybrid
    assert h is not None
    return h.num_key_heads * h.key_head_dim, h.num_value_heads * h.value_head_dim, h.num_value_heads


def _layer_attention_weights(a: QwenArch) -> int:
    q_out, q, kv = _attention_dims(a)
    return a.hidden_size * (q_out + 2 * kv) + q * a.hidden_size


def _layer_linear_attention_weights(a: QwenArch) -> int:
    qk, v, heads = _linear_attention_dims(a)
    return a.hidden_size * (2 * qk + 2 * v + 2 * heads) + v * a.hidden_size  # in_proj, out_proj


def _layer_mlp_weights(a: QwenArch) -> int:
    h = a.hidden_size
    if not a.is_moe:
        return 3 * h * a.ffn_hidden_size
    n = h * a.num_experts + a.moe_router_topk * 3 * h * a.moe_ffn_hidden_size
    if a.shared_expert_intermediate_size:
        n += 3 * h * a.shared_expert_intermediate_size + h  # shared expert and its sigmoid gate
    return n


def active_matmul_weights(a: QwenArch) -> int:
    """N: matmul weights per token, output layer included (the embedding lookup is no matmul)."""
    mixers = sum(
        _layer_attention_weights(a) if t == "full_attention" else _layer_linear_attention_weights(a)
        for t in _layer_types(a)
    )
    return mixers + a.num_layers * _layer_mlp_weights(a) + a.hidden_size * a.vocab_size


def _slot_dims(a: QwenArch, site: str, slot: str) -> tuple[int, int, int]:
    """(d_in, d_out, uses per token) of one adapter slot."""
    h = a.hidden_size
    if site == "linear_qkv":
        q_out, _, kv = _attention_dims(a)
        return h, q_out if slot == "q_proj" else kv, 1
    if site == "linear_proj":
        return _attention_dims(a)[1], h, 1
    if site in ("in_proj", "in_proj_fused", "out_proj"):
        qk, v, heads = _linear_attention_dims(a)
        outputs = {
            "in_proj_qkv": 2 * qk + v,
            "in_proj_z": v,
            "in_proj_b": heads,
            "in_proj_a": heads,
            "in_proj_qkvz": 2 * qk + 2 * v,
            "in_proj_ba": 2 * heads,
        }
        return (v, h, 1) if site == "out_proj" else (h, outputs[slot], 1)
    if site in ("linear_fc1", "linear_fc2"):
        f = (a.shared_expert_intermediate_size if a.is_moe else None) or a.ffn_hidden_size
        return (h, f, 1) if site == "linear_fc1" else (f, h, 1)
    if site == "experts.linear_fc1":
        return h, 2 * a.moe_ffn_hidden_size, a.moe_router_topk
    if site == "experts.linear_fc2":
        return a.moe_ffn_hidden_size, h, a.moe_router_topk
    if site == "router":
        return h, a.num_experts, 1
    raise ValueError(f"unknown LoRA site {site!r}")


def _site_in_layer(a: QwenArch, site: str, layer_type: str) -> bool:
    """Whether a layer of ``layer_type`` has the linear that LoRA site ``site`` adapts."""
    if site in ("linear_qkv", "linear_proj"):
        return layer_type == "full_attention"
    if site in ("in_proj", "in_proj_fused", "out_proj"):
        return layer_type == "linear_attention"
    if site.startswith("experts.") or site == "router":
        return a.is_moe
    return not a.is_moe or bool(a.shared_expert_intermediate_size)  # dense MLP or shared expert


def active_adapter_weights(a: QwenArch, lora: LoraConfig) -> int:
    """N_lora: adapter weights per token for ``lora`` resolved as twinkle-specs and peft do."""
    from twinkle_specs.lora.config import in_proj_site

    # as twinkle_specs.lora.spec.fused_experts: peft maps MLP names to the routed experts of Qwen3-MoE
    # (MoE with q/k norm) and Qwen3-Next, to the shared expert of Qwen2-MoE and Qwen3.5-MoE
    fused = a.is_moe and (a.hybrid.fused_projections if a.hybrid is not None else a.qk_layernorm)
    sites = lora.resolve(
        fused_experts=fused, shared_expert=bool(a.shared_expert_intermediate_size), in_proj=in_proj_site(a)
    )
    total = 0
    for layer_type in _layer_types(a):
        for site, slots in sites.items():
            if not _site_in_layer(a, site, layer_type):
                continue
            for slot, spec in slots.items():
                d_in, d_out, uses = _slot_dims(a, site, slot)
                total += uses * spec.r * (d_in + d_out)
    return total


def attention_flops_forward(a: QwenArch, sequence_lengths: Sequence[int]) -> float:
    """A: causal attention core (QK^T and AV), forward, each sequence attending within itself."""
    full = _layer_types(a).count("full_attention")
    return 2.0 * full * a.num_attention_heads * a.kv_channels * sum(s * s for s in sequence_lengths)


def linear_attention_flops_forward(a: QwenArch, tokens: int) -> float:
    """D: the chunked gated delta rule of the Gated DeltaNet layers, forward (module docstring)."""
    if a.hybrid is None:
        return 0.0
    h = a.hybrid
    layers = _layer_types(a).count("linear_attention")
    return 2.0 * layers * 4 * h.num_value_heads * h.key_head_dim * h.value_head_dim * tokens


@dataclass(frozen=True)
class StepFlops:
    mode: str  # full | lora | frozen
    tokens: int
    matmul_weights: int  # N
    adapter_weights: int  # N_lora
    attention_forward: float  # A
    linear_attention_forward: float  # D
    total: float

    def as_dict(self) -> dict:
        return asdict(self)


def step_flops(
    a: QwenArch,
    *,
    seq_len: int,
    micro_batch_size: int,
    mode: str,
    lora: LoraConfig | None = None,
    sequence_lengths: Sequence[int] | None = None,
) -> StepFlops:
    """Model FLOPs of one training step of ``micro_batch_size`` sequences of ``seq_len`` or, for a packed
    row, of its ``sequence_lengths`` (the conversations' tokens; the row's padding is no model work)."""
    lengths = list(sequence_lengths) if sequence_lengths is not None else [seq_len] * micro_batch_size
    tokens = sum(lengths)
    n = active_matmul_weights(a)
    attn, delta = attention_flops_forward(a, lengths), linear_attention_flops_forward(a, tokens)
    mixing = attn + delta
    n_lora = 0
    if mode == "full":
        total = 6.0 * n * tokens + 3.0 * mixing
    elif mode == "lora":
        if lora is None:
            raise ValueError("mode='lora' needs the LoraConfig")
        n_lora = active_adapter_weights(a, lora)
        total = 4.0 * n * tokens + 6.0 * n_lora * tokens + 3.0 * mixing
    elif mode == "frozen":
        total = 4.0 * n * tokens + 3.0 * mixing
    else:
        raise ValueError(f"mode must be full, lora or frozen, not {mode!r}")
    return StepFlops(mode, tokens, n, n_lora, attn, delta, total)
