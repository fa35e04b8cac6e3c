"""Model FLOPs of one training step, aware of which weights are trained (see docs/benchmarks.md).

Counts matrix multiplications only (norms, activations, rotary, softmax and the optimizer are left
out), with multiply-add = 2 FLOPs, and no recomputation (flash attention's backward recompute is not
model work). For T tokens in sequences of length S:

    N      = matmul weights one token passes through: per layer q, k, v, o, the MLP (MoE: router,
             top-k routed experts, shared expert and its gate), plus the output layer h * V
    A      = causal attention scores and weighted sum, forward: 2 * L * S * n_heads * head_dim * T
             (4 * S * n_heads * head_dim per token and layer, halved by the causal mask)
    N_lora = adapter weights one token passes through: per adapted projection r * (d_in + d_out),
             routed-expert adapters counted top-k times

    full fine-tune : 6 * N * T + 3 * A                       (forward, input gradient, weight gradient)
    LoRA           : 4 * N * T + 6 * N_lora * T + 3 * A      (frozen weights need no weight gradient)
    frozen base    : 4 * N * T + 3 * A                       (forward and backward, nothing trained)

The same count is used for the Megatron and the Hugging Face runs of a shape, so MFU compares work
done per second, not implementation choices.
"""

from __future__ import annotations

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


def _layer_attention_weights(a: QwenArch) -> int:
    q = a.num_attention_heads * a.kv_channels
    kv = a.num_query_groups * a.kv_channels
    return a.hidden_size * (q + 2 * kv) + q * a.hidden_size


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
    return a.num_layers * (_layer_attention_weights(a) + _layer_mlp_weights(a)) + a.hidden_size * a.vocab_size


def _slot_dims(a: QwenArch, site: str, slot: str) -> tuple[int, int, int]:
    """(d_in, d_out, uses per token) of one adapter slot."""
    h, q, kv = a.hidden_size, a.num_attention_heads * a.kv_channels, a.num_query_groups * a.kv_channels
    if site == "linear_qkv":
        return h, q if slot == "q_proj" else kv, 1
    if site == "linear_proj":
        return q, h, 1
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


def active_adapter_weights(a: QwenArch, lora: LoraConfig) -> int:
    """N_lora: adapter weights per token for ``lora`` resolved as twinkle-specs and peft do."""
    sites = lora.resolve(
        fused_experts=a.family == "qwen3_moe", shared_expert=bool(a.shared_expert_intermediate_size)
    )
    per_layer = 0
    for site, slots in sites.items():
        if site.startswith("experts.") or site == "router":
            if not a.is_moe:
                continue
        elif site in ("linear_fc1", "linear_fc2") and a.is_moe and not a.shared_expert_intermediate_size:
            continue
        for slot, spec in slots.items():
            d_in, d_out, uses = _slot_dims(a, site, slot)
            per_layer += uses * spec.r * (d_in + d_out)
    return a.num_layers * per_layer


def attention_flops_forward(a: QwenArch, seq_len: int, tokens: int) -> float:
    """A: causal attention core (QK^T and AV), forward, for ``tokens`` tokens in sequences of ``seq_len``."""
    return 2.0 * a.num_layers * seq_len * a.num_attention_heads * a.kv_channels * tokens


@dataclass(frozen=True)
class StepFlops:
    mode: str  # full | lora | frozen
    tokens: int
    matmul_weights: int  # N
    adapter_weights: int  # N_lora
    attention_forward: float  # A
    total: float

    def as_dict(self) -> dict:
        return asdict(self)


def step_flops(
    a: QwenArch, *, seq_len: int, micro_batch_size: int, mode: str, lora: LoraConfig | None = None
) -> StepFlops:
    """Model FLOPs of one training step of ``micro_batch_size`` sequences (formula in the module doc)."""
    tokens = seq_len * micro_batch_size
    n = active_matmul_weights(a)
    attn = attention_flops_forward(a, seq_len, tokens)
    n_lora = 0
    if mode == "full":
        total = 6.0 * n * tokens + 3.0 * attn
    elif mode == "lora":
        if lora is None:
            raise ValueError("mode='lora' needs the LoraConfig")
        n_lora = active_adapter_weights(a, lora)
        total = 4.0 * n * tokens + 6.0 * n_lora * tokens + 3.0 * attn
    elif mode == "frozen":
        total = 4.0 * n * tokens + 3.0 * attn
    else:
        raise ValueError(f"mode must be full, lora or frozen, not {mode!r}")
    return StepFlops(mode, tokens, n, n_lora, attn, total)
