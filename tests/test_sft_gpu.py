"""Packed SFT rows on a GPU: ``build_model``'s Transformer Engine path (TE's THD attention and RoPE, the
fused LoRA kernels where they apply) in bf16 with a LoRA adapter. Each conversation's logits in the packed
row against the same model on that conversation alone, and the packed row's answer-only loss against
transformers + PEFT in fp32 on the conversations unpacked. And stock ``pretrain_gpt.py --sft`` through
the launcher with LoRA, against transformers and the exported PEFT adapter.

Writes the measured statistics to $TWINKLE_EVIDENCE_DIR/sft-gpu.json when that is set.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from chat_data import answer_loss, conversations, pack, save_tokenizer
from conftest import torchrun
from gpu_checks import Evidence, count_calls
from hybrid_models import hf_checkpoint_model, make_hybrid_checkpoint
from models import make_checkpoint
from test_sft import ROW, TARGETS, _packed_params, _with_system

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with Transformer Engine"),
]

EVIDENCE = Evidence("sft-gpu.json")
# bf16 answer-only loss of the packed row against transformers + peft in fp32, relative; measured on an
# H100 (2026-11-25): 2.3e-4 to 6.8e-4 in-process, 2.9e-5 (iteration 1) and 4.2e-4 (the exported adapter)
# through pretrain_gpt.py
LOSS_RTOL = 2e-3


@pytest.mark.parametrize(
    ("kind", "flash_attn_4"),
    [("qwen3", False), ("qwen3_moe", False), ("qwen3_next", False), ("qwen3", True), ("qwen3_next", True)],
)
def test_packed_row_on_the_te_path(kind, flash_attn_4, tmp_path, gpu, monkeypatch):
    """With ``flash_attn_4`` the attention layers run on FlashAttention-4: the packed row on its varlen call,
    each conversation alone on its plain one (the hybrid's gated attention layers too)."""
    import peft
    from test_lora_support import hf_model, randomize_peft

    import twinkle_specs as ts
    from twinkle_specs import LoraConfig, flash_attention, load_peft_adapter
    from twinkle_specs.sft import QwenChatTokenizer

    calls = {}
    if flash_attn_4:
        pytest.importorskip("flash_attn.cute", reason="needs FlashAttention-4 (the flash-attn-4 extra)")
        calls = {
            name: count_calls(monkeypatch, flash_attention, name) for name in ("attend", "attend_packed")
        }

    hf = tmp_path / kind
    (make_hybrid_checkpoint if kind == "qwen3_next" else make_checkpoint)(kind, hf)
    save_tokenizer(hf, "qwen3")
    ref = peft.get_peft_model(hf_model(hf), peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[kind]))
    randomize_peft(ref)
    ref.save_pretrained(tmp_path / "adapter")
    ref = ref.cuda().eval()

    convs, tok = conversations(), QwenChatTokenizer(hf)
    reference, count = answer_loss(ref, hf, "qwen3", convs)

    model = ts.build_model(
        hf,
        lora=LoraConfig.from_peft(tmp_path / "adapter"),
        params_dtype=torch.bfloat16,
        bf16=True,
        parallel_output=False,
        flash_attn_4=flash_attn_4,
    ).eval()
    load_peft_adapter(model, tmp_path / "adapter")
    row = {k: v.cuda() for k, v in pack(tok, convs, ROW).items()}
    params = _packed_params(row["cu_seqlens"])
    with torch.no_grad():
        losses = model(
            row["tokens"], row["position_ids"], None, labels=row["labels"], packed_seq_params=params
        )
        logits = model(row["tokens"], row["position_ids"], None, packed_seq_params=params)[0].float()
        ours = ((losses.double() * row["loss_mask"]).sum() / row["loss_mask"].sum()).item()
        packed_vs_alone, alone_vs_fp32 = [], []
        bounds = row["cu_seqlens"].tolist()
        for i, conv in enumerate(convs):
            alone = torch.as_tensor(tok.tokenize_conversation(conv, False, False))[None].cuda()
            n = alone.shape[1]
            own = model(alone, torch.arange(n, device="cuda")[None], None)[0].float()
            truth = ref(alone).logits[0].float()
            v = truth.shape[-1]  # the checkpoint's vocabulary (ours may be padded)
            packed_vs_alone.append((logits[bounds[i] : bounds[i] + n, :v] - own[:, :v]).abs().mean().item())
            alone_vs_fp32.append((own[:, :v] - truth).abs().mean().item())
    layers = model.decoder.layers
    modules = sorted({f"{type(m.self_attention).__name__}/{type(m.mlp).__name__}" for m in layers})
    stats = dict(
        modules=modules,
        packed_loss_bf16=ours,
        transformers_peft_loss_fp32=reference,
        loss_rel_diff=abs(ours - reference) / reference,
        packed_vs_alone_mean_abs=max(packed_vs_alone),
        alone_bf16_vs_fp32_mean_abs=max(alone_vs_fp32),
    )
    if flash_attn_4:
        attention_layers = sum(
            isinstance(m, flash_attention.flash_attention_4_class()) for m in model.modules()
        )
        counts = {name: len(made) for name, made in calls.items()}
        stats["flash_attn_4_calls"] = dict(counts, layers=attention_layers)
    EVIDENCE.record(f"{kind}-flash-attn-4" if flash_attn_4 else kind, **stats)
    print(kind, stats)
    if flash_attn_4:  # two packed forwards; one plain forward per conversation
        assert counts == {"attend": attention_layers * len(convs), "attend_packed": 2 * attention_layers}, (
            counts
        )
    assert row["loss_mask"].sum() == count
    assert stats["loss_rel_diff"] <= LOSS_RTOL, stats
    # packing changes a conversation's logits less than bf16 itself does (attention across sequences,
    # or RoPE not restarting per sequence, would change them by far more)
    assert stats["packed_vs_alone_mean_abs"] <= stats["alone_bf16_vs_fp32_mean_abs"], stats


def _sft_lora_launch(
    kind: str, flash_attn_4: bool, tmp_path: Path, **text
) -> tuple[list[str], dict[str, str]]:
    """The launcher's ``pretrain_gpt.py --sft`` LoRA command on a tiny ``kind`` checkpoint (``text``: config
    fields to change) and 16 rows of three conversations, saving and exporting the PEFT adapter at iteration 3,
    and its environment (the first 8 micro-batches dumped to ``tmp_path/batches``)."""
    from test_launch_gpu import train_flags

    if kind.startswith("qwen3_5"):
        hf = make_hybrid_checkpoint(kind, tmp_path / kind, max_position_embeddings=ROW, **text)
    else:
        hf = make_checkpoint(kind, tmp_path / kind, max_position_embeddings=ROW, **text)
    save_tokenizer(hf, "qwen3")
    convs = [_with_system(c) for c in conversations(48, seed=7)]
    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(
            json.dumps({"messages": [m for c in convs[i : i + 3] for m in c]}) + "\n" for i in range(0, 48, 3)
        )
    )
    flags = train_flags(hf, 6)
    flags[flags.index("--micro-batch-size") + 1] = "1"
    flags[flags.index("--global-batch-size") + 1] = "2"
    flags[flags.index("--seq-length") + 1] = str(ROW)
    cmd = [
        *torchrun(1),
        "-m",
        "twinkle_specs.launch",
        *flags,
        "--sft",
        "--data-path",
        str(data),
        "--split",
        "100,0,0",
        "--lora-rank",
        "8",
        "--lora-alpha",
        "16",
        "--save",
        str(tmp_path / "ck"),
        "--save-interval",
        "3",
        "--hf-export",
        str(tmp_path / "export"),
        "--hf-export-on-save",
        *(["--flash-attn-4"] if flash_attn_4 else []),
    ]
    env = dict(os.environ, TWINKLE_DUMP_BATCHES=str(tmp_path / "batches"), TWINKLE_DUMP_BATCHES_COUNT="8")
    return cmd, env


def _transformers_loss(hf: Path, dumps: Path, adapter: Path | None, micro_batches: range) -> float:
    """transformers' fp32 answer-only loss (with the PEFT ``adapter`` where given) on the dumped micro-batches'
    packed conversations, each run alone."""
    model = hf_checkpoint_model(hf).cuda()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    total, count = 0.0, 0.0
    with torch.no_grad():
        for mb in micro_batches:
            b = torch.load(dumps / f"dp0-mb{mb}-pp0.pt")
            cu = b["cu_seqlens"].flatten().tolist()
            for a, e in zip(cu[:-1], cu[1:], strict=True):  # each packed sequence alone
                logits = model(b["tokens"][:, a:e].cuda()).logits[0].float()
                ce = torch.nn.functional.cross_entropy(
                    logits, b["labels"][0, a:e].cuda().clamp(min=0), reduction="none"
                )
                mask = b["loss_mask"][0, a:e].cuda()
                total += (ce * mask).sum().item()
                count += mask.sum().item()
    return total / count


def _check_sft_lora_run(kind: str, tmp_path: Path, name: str, losses: dict[int, float], log: str) -> None:
    """Iteration 1's loss (a zero adapter) is transformers', iteration 4's is peft's with the adapter exported
    at iteration 3, and the loss falls."""
    hf, dumps = tmp_path / kind, tmp_path / "batches"
    assert sorted(losses) == list(range(1, 7)), log[-3000:]
    first = _transformers_loss(hf, dumps, None, range(0, 2))
    peft4 = _transformers_loss(hf, dumps, tmp_path / "export" / "iter_0000003", range(6, 8))
    stats = dict(megatron=losses, transformers_iter1=first, peft_iter4=peft4)
    EVIDENCE.record(f"pretrain-gpt-{name}", **stats)
    print(stats)
    assert abs(losses[1] - first) <= LOSS_RTOL * first, stats
    assert abs(losses[4] - peft4) <= LOSS_RTOL * peft4, stats
    assert losses[6] < losses[1], stats


needs_megatron_lm = pytest.mark.skipif(
    not os.environ.get("MEGATRON_LM_ROOT"), reason="needs a stock Megatron-LM checkout in $MEGATRON_LM_ROOT"
)
needs_datasets = pytest.mark.skipif(
    importlib.util.find_spec("datasets") is None, reason="needs the sft extra (datasets)"
)


@pytest.mark.parametrize(
    ("kind", "flash_attn_4"),
    [("qwen3", False), ("qwen3_moe", False), ("qwen3_5_vl", False), ("qwen3", True), ("qwen3_5_vl", True)],
)
@needs_megatron_lm
@needs_datasets
def test_pretrain_gpt_sft_lora_matches_transformers_and_exports(kind, flash_attn_4, tmp_path):
    """Stock pretrain_gpt.py --sft through the launcher, LoRA in bf16 on Qwen3, Qwen3-MoE and Qwen3.5 (the
    multimodal checkpoint; Gated DeltaNet layers on packed rows): iteration 1's loss (a zero adapter) is
    transformers' on the same conversations with the answer-only mask; the PEFT adapter exported at
    iteration 3's save gives in peft the loss Megatron logs at iteration 4; and the loss falls. With
    ``--flash-attn-4`` the packed rows Megatron-LM builds run on FlashAttention-4's varlen kernels."""
    from test_launch_gpu import run_logged

    if flash_attn_4:
        pytest.importorskip("flash_attn.cute", reason="needs FlashAttention-4 (the flash-attn-4 extra)")
    cmd, env = _sft_lora_launch(kind, flash_attn_4, tmp_path)
    name = f"sft-lora-{kind}" + ("-flash-attn-4" if flash_attn_4 else "")
    losses, log = run_logged(cmd, name, env)
    assert ("twinkle_specs: attention on FlashAttention-4 in" in log) is flash_attn_4, log[-3000:]
    _check_sft_lora_run(kind, tmp_path, name, losses, log)


@needs_megatron_lm
@needs_datasets
def test_pretrain_gpt_sft_at_heads_of_256_trains_right_or_is_refused(tmp_path):
    """Qwen3.5 (the multimodal checkpoint) with attention heads of 256, as Qwen3.5 and Qwen3-Next have, through
    the launcher with --sft on Transformer Engine's attention. Where ``packed_attention_check`` says this GPU's
    cuDNN trains TE's packed attention wrong there (Hopper, cuDNN before 9.18), the launch ends before its first
    iteration with that refusal (in $TWINKLE_CONFIG_ERROR_FILE, as the Slurm script reads it); elsewhere it
    trains and matches transformers and peft as at small heads."""
    from test_launch_gpu import ROOT, run_logged

    from twinkle_specs.packed_attention_check import current_refusal, te_cudnn_version

    # this process loads TE's cuDNN as the launch's rank does (the same environment)
    expected = current_refusal(256)
    cmd, env = _sft_lora_launch("qwen3_5_vl", False, tmp_path, head_dim=256)
    name = f"sft-lora-qwen3_5_vl-head-dim-256-cudnn{te_cudnn_version()}"  # a record per cuDNN it runs under
    if expected is None:
        losses, log = run_logged(cmd, name, env)
        _check_sft_lora_run("qwen3_5_vl", tmp_path, name, losses, log)
        return
    marker = tmp_path / "config-error.txt"
    proc = subprocess.run(
        cmd, capture_output=True, text=True, cwd=ROOT, env=env | {"TWINKLE_CONFIG_ERROR_FILE": str(marker)}
    )
    log = proc.stdout + proc.stderr
    EVIDENCE.record(f"pretrain-gpt-{name}", refused=True, returncode=proc.returncode, log_tail=log[-1500:])
    assert proc.returncode != 0 and marker.read_text() == f"--sft: {expected}\n", log[-3000:]
    assert f"twinkle_specs.launch: error: --sft: {expected}" in log and " iteration " not in log, log[-3000:]


def _megatron_has_sft_tokenizer() -> bool:
    try:
        return importlib.util.find_spec("megatron.core.tokenizers.text.libraries.sft_tokenizer") is not None
    except ImportError:
        return False


def _megatron_sft_row(hf, messages: list[dict], length: int) -> dict[str, torch.Tensor]:
    """The row Megatron-LM's own SFTDataset (core_v0.19) makes of one JSONL line with its SFTTokenizer in
    the ``default`` prompt format, built by that code itself."""
    import types

    import numpy as np
    from megatron.core.tokenizers import MegatronTokenizer
    from megatron.training.datasets.sft_dataset import SFTDataset

    tokenizer = MegatronTokenizer.from_pretrained(
        tokenizer_path=str(hf), metadata_path={"library": "sft"}, prompt_format="default"
    )
    dataset = SFTDataset.__new__(SFTDataset)  # only __getitem__'s inputs, none of the index building
    dataset.dataset, dataset.indices = [messages], np.array([0])
    dataset.config = types.SimpleNamespace(
        tokenizer=tokenizer,
        sequence_length=length,
        context_parallel_size=1,
        reset_position_ids=False,
        create_attention_mask=False,
        reset_attention_mask=False,
    )
    return dataset[0]


@needs_megatron_lm
@needs_datasets
@pytest.mark.skipif(
    not _megatron_has_sft_tokenizer(),
    reason="Megatron-LM's SFTTokenizer has a prompt format for a Qwen chat template from core_v0.19 on",
)
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "qwen3_5_vl"])
def test_plain_pretrain_gpt_sft_with_megatron_sft_tokenizer(kind, tmp_path):
    """Without the launcher: `twinkle-specs convert`, then the unmodified pretrain_gpt.py with `twinkle-specs
    args`' flags (our spec), --sft and Megatron-LM's own SFTTokenizer in its ``default`` prompt format (the
    checkpoint's chat template; Megatron then trains on every token: the answer-only mask is the launcher's).
    Every JSONL line is the same row of three conversations, so each micro-batch is that row whatever order
    Megatron draws: iteration 1's loss (full fine-tune, bf16) equals transformers' fp32 loss on the row's
    conversations run one by one with the row's labels and mask; and the loss falls. Qwen3.5 (the multimodal
    checkpoint): its Gated DeltaNet layers restart at each conversation of megatron's packed row."""
    from test_launch_gpu import LOSS_RTOL as STEP_RTOL
    from test_launch_gpu import ROOT, run_logged, twinkle_cli

    from twinkle_specs import megatron_args_from_hf

    make = make_hybrid_checkpoint if kind.startswith("qwen3_5") else make_checkpoint
    hf = make(kind, tmp_path / kind, max_position_embeddings=ROW)
    save_tokenizer(hf, "qwen3")
    line = [m for c in (_with_system(c) for c in conversations(3, seed=5)) for m in c]
    data = tmp_path / "chat.jsonl"
    data.write_text((json.dumps({"messages": line}) + "\n") * 8)
    twinkle_cli("convert", "--hf-model", str(hf), "--save", str(tmp_path / "ck"))
    flags = [
        *megatron_args_from_hf(hf),
        "--load",
        str(tmp_path / "ck"),
        "--finetune",
        "--use-checkpoint-args",
    ]
    flags += ["--tokenizer-type", "SFTTokenizer", "--tokenizer-model", str(hf)]
    flags += [
        "--sft-tokenizer-prompt-format",
        "default",
        "--sft",
        "--data-path",
        str(data),
        "--split",
        "100,0,0",
    ]
    flags += [
        "--no-create-attention-mask-in-dataloader",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "2",
    ]
    flags += ["--seq-length", str(ROW), "--train-iters", "4", "--eval-interval", "1000", "--eval-iters", "0"]
    flags += ["--lr", "2e-3", "--lr-decay-style", "constant", "--bf16", "--log-interval", "1"]
    flags += ["--no-gradient-accumulation-fusion"]
    losses, log = run_logged(
        [*torchrun(1), str(Path(ROOT) / "pretrain_gpt.py"), *flags],
        f"plain-pretrain-gpt-sft-{kind}",
        dict(os.environ),
    )
    assert sorted(losses) == [1, 2, 3, 4], log[-3000:]

    row = _megatron_sft_row(hf, line, ROW)
    cu = row["cu_seqlens"][row["cu_seqlens"] < ROW].tolist() + [ROW]  # the padded table ends in repeats
    assert len(cu) > 3, cu  # several conversations in the row
    model = hf_checkpoint_model(hf).cuda()
    total, count = 0.0, 0.0
    with torch.no_grad():
        for a, e in zip(cu[:-1], cu[1:], strict=True):  # each conversation alone, the row's labels
            logits = model(row["tokens"][None, a:e].cuda()).logits[0].float()
            ce = torch.nn.functional.cross_entropy(logits, row["labels"][a:e].cuda(), reduction="none")
            total += (ce * row["loss_mask"][a:e].cuda()).sum().item()
            count += row["loss_mask"][a:e].sum().item()
    first = total / count
    stats = dict(megatron=losses, transformers_iter1=first, conversations=len(cu) - 1)
    EVIDENCE.record(f"plain-pretrain-gpt-sft-full-{kind}", **stats)
    print(stats)
    assert abs(losses[1] - first) <= STEP_RTOL * first, stats
    assert losses[4] < losses[1], stats
