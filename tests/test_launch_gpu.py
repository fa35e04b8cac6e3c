"""End to end on the GPU machine: stock Megatron-LM pretrain_gpt.py through twinkle_specs.launch.

Needs $MEGATRON_LM_ROOT (a stock checkout), a CUDA GPU with Transformer Engine, and for the parallel
layouts 2 GPUs. Logs and a summary go to $TWINKLE_EVIDENCE_DIR when set.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port
from gpu_checks import Evidence
from models import make_checkpoint

ROOT = os.environ.get("MEGATRON_LM_ROOT")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with Transformer Engine"),
    pytest.mark.skipif(not ROOT, reason="needs a stock Megatron-LM checkout in $MEGATRON_LM_ROOT"),
]
LOSS_RTOL = 0.015  # bf16 training step vs transformers fp32 on the same tokens
EVIDENCE = Evidence("launch-summary.json")


def two_gpus():
    return pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """Small checkpoints with a real byte-level BPE tokenizer saved beside them, and a corpus."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("e2e")
    words = ["alpha", "beta", "gamma", "delta", "qwen", "megatron", "tensor", "pipeline", "expert", "adapter"]
    g = torch.Generator().manual_seed(0)
    lines = [
        " ".join(words[i] for i in torch.randint(0, len(words), (40,), generator=g).tolist())
        for _ in range(400)
    ]
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=300, special_tokens=["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    dirs = {}
    for kind in ("qwen3", "qwen2_5", "qwen3_moe"):
        d = make_checkpoint(kind, root / kind, vocab_size=512)
        tok.save_pretrained(d)
        dirs[kind] = d
    return {"root": root, "corpus": corpus, **dirs}


def pretrain(hf: Path, out: Path, *flags: str, nproc: int = 1, iters: int = 6, dump: bool = True):
    dump_dir = out / "batches"
    env = dict(os.environ, TWINKLE_DUMP_BATCHES=str(dump_dir) if dump else "", TWINKLE_DUMP_BATCHES_COUNT="2")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        "-m",
        "twinkle_specs.launch",
        str(Path(ROOT) / "pretrain_gpt.py"),
        "--hf-model",
        str(hf),
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--seq-length",
        "128",
        "--train-iters",
        str(iters),
        "--eval-interval",
        "1000",
        "--eval-iters",
        "0",
        "--lr",
        "2e-3",
        "--lr-decay-style",
        "constant",
        "--bf16",
        "--log-interval",
        "1",
        "--no-gradient-accumulation-fusion",
        "--seed",
        "1234",
        *flags,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=500)
    log = proc.stdout + proc.stderr
    evidence = os.environ.get("TWINKLE_EVIDENCE_DIR")
    if evidence:
        Path(evidence, f"launch-{out.name}.log").write_text(" ".join(cmd) + "\n\n" + log[-12000:])
    assert proc.returncode == 0, log[-5000:]
    losses = {
        int(m[1]): float(m[2]) for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+)", log)
    }
    return losses, dump_dir, log


def hf_loss(hf: Path, dump_dir: Path, adapter: Path | None = None) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).cuda().eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    losses = []
    with torch.no_grad():
        for f in sorted(dump_dir.glob("*-mb*.pt")):
            batch = torch.load(f)
            logits = model(batch["tokens"].cuda()).logits.float()
            losses.append(
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].cuda().flatten())
            )
    assert losses, f"no batches dumped in {dump_dir}"
    return torch.stack(losses).mean().item()


def _check_first_loss(name: str, losses: dict[int, float], hf: Path, dump_dir: Path, **extra) -> None:
    ref = hf_loss(hf, dump_dir)
    EVIDENCE.record(name, megatron_iter1=losses[1], transformers=ref, last=losses[max(losses)], **extra)
    assert abs(losses[1] - ref) <= LOSS_RTOL * ref, (losses[1], ref)
    assert losses[max(losses)] < losses[1], losses


def test_full_finetune_qwen3_real_dataset(e2e):
    prefix = e2e["root"] / "corpus"
    subprocess.run(
        [
            sys.executable,
            str(Path(ROOT) / "tools" / "preprocess_data.py"),
            "--input",
            str(e2e["corpus"]),
            "--output-prefix",
            str(prefix),
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            str(e2e["qwen3"]),
            "--append-eod",
            "--workers",
            "1",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    out = e2e["root"] / "full-qwen3-data"
    losses, dump, _ = pretrain(
        e2e["qwen3"], out, "--data-path", f"{prefix}_text_document", "--split", "100,0,0"
    )
    _check_first_loss("full-qwen3-indexed-data", losses, e2e["qwen3"], dump)


def test_full_finetune_qwen2_5_mock(e2e):
    out = e2e["root"] / "full-qwen2_5"
    losses, dump, _ = pretrain(e2e["qwen2_5"], out, "--mock-data")
    _check_first_loss("full-qwen2.5-mock", losses, e2e["qwen2_5"], dump)


def test_lora_qwen3_save_resume_and_peft_export(e2e):
    hf, root = e2e["qwen3"], e2e["root"]
    lora = ["--mock-data", "--lora-rank", "8", "--lora-alpha", "16"]
    ck = root / "lora-ck"
    first, dump1, _ = pretrain(
        hf,
        root / "lora-a1",
        *lora,
        "--save",
        str(ck),
        "--save-interval",
        "5",
        "--hf-export",
        str(root / "adapter5"),
        iters=5,
    )
    _check_first_loss("lora-qwen3-first-run", first, hf, dump1)
    resumed, dump2, log = pretrain(
        hf, root / "lora-a2", *lora, "--load", str(ck), "--override-opt_param-scheduler", iters=10
    )
    straight, _, _ = pretrain(hf, root / "lora-b", *lora, iters=10, dump=False)
    assert "iteration        6/      10" in log and min(resumed) == 6, sorted(resumed)
    diffs = {i: abs(resumed[i] - straight[i]) / straight[i] for i in resumed}
    # The exported PEFT adapter (after iteration 5) reproduces the resumed run's iteration-6 loss.
    peft_loss = hf_loss(hf, dump2, adapter=root / "adapter5")
    EVIDENCE.record(
        "lora-qwen3-resume", resumed=resumed, straight={i: straight[i] for i in resumed}, peft_iter6=peft_loss
    )
    assert max(diffs.values()) <= 2e-3, diffs
    assert abs(resumed[6] - peft_loss) <= LOSS_RTOL * peft_loss, (resumed[6], peft_loss)
    saved = list((ck / "iter_0000005").glob("*"))
    assert saved, "no checkpoint written"


@two_gpus()
@pytest.mark.parametrize(
    "layout",
    [["--tensor-model-parallel-size", "2", "--sequence-parallel"], ["--pipeline-model-parallel-size", "2"]],
)
def test_lora_qwen3_two_gpus(e2e, layout):
    name = "lora-qwen3-" + ("tp2-sp" if "--sequence-parallel" in layout else "pp2")
    losses, dump, _ = pretrain(
        e2e["qwen3"], e2e["root"] / name, "--mock-data", "--lora-rank", "8", *layout, nproc=2
    )
    _check_first_loss(name, losses, e2e["qwen3"], dump)


@two_gpus()
@pytest.mark.parametrize("lora", [[], ["--lora-rank", "8"]])
def test_qwen3_moe_expert_parallel(e2e, lora):
    name = "qwen3-moe-ep2-" + ("lora" if lora else "full")
    flags = [
        "--mock-data",
        "--expert-model-parallel-size",
        "2",
        "--moe-token-dispatcher-type",
        "alltoall",
        *lora,
    ]
    losses, dump, _ = pretrain(e2e["qwen3_moe"], e2e["root"] / name, *flags, nproc=2)
    _check_first_loss(name, losses, e2e["qwen3_moe"], dump)
