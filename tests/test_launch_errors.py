"""``twinkle_specs.launch`` on bad flags: one line naming the flag and what is allowed, exit code 2 (the
exit code the Slurm script does not requeue), and the message in $TWINKLE_CONFIG_ERROR_FILE."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from twinkle_specs.launch import main

STANDIN = Path(__file__).parent / "standin"
SCRIPT = str(STANDIN / "standin_pretrain_gpt.py")


def _refused(capsys, argv: list[str]) -> str:
    capsys.readouterr()  # drop what fixtures printed
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("twinkle_specs.launch: error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--lora-rank", "-1"], ["argument --lora-rank: '-1'", "positive whole number", "0 for none"]),
        (["--lora-rank", "four"], ["argument --lora-rank: 'four'"]),
        (["--lora-rank", "8", "--lora-alpha", "0"], ["argument --lora-alpha: '0'", "positive number"]),
        (["--lora-rank", "8", "--lora-alpha", "-2"], ["argument --lora-alpha: '-2'"]),
        (["--lora-rank", "8", "--lora-alpha", "nan"], ["argument --lora-alpha: 'nan'"]),
        (["--lora-rank", "8", "--lora-dropout", "1.5"], ["argument --lora-dropout: '1.5'", "[0, 1)"]),
        (["--lora-rank", "8", "--lora-dropout", "-0.1"], ["argument --lora-dropout: '-0.1'"]),
        (
            ["--lora-rank", "8", "--lora-target", "q_proj,qkv_proj"],
            [
                "argument --lora-target: 'q_proj,qkv_proj'",
                "unknown 'qkv_proj'",
                "all-linear, q_proj",
                "router",
            ],
        ),
        (["--lora-rank", "8", "--lora-target", ","], ["argument --lora-target: ','", "no module named"]),
        (["--lora-alpha", "32"], ["--lora-alpha need(s) --lora-rank R"]),
        (["--lora-rank", "0", "--lora-target", "q_proj"], ["--lora-target need(s) --lora-rank R"]),
        (["--hf-export-on-save"], ["--hf-export-on-save needs --hf-export DIR"]),
        (["--lora-rank", "4", "--hf-export-merged"], ["--hf-export-merged needs --hf-export DIR"]),
        (["--hf-export-expert-layout", "per-expert"], ["--hf-export-expert-layout need(s) --lora-rank R"]),
        (
            ["--lora-rank", "4", "--hf-export-expert-layout", "per-expert"],
            ["--hf-export-expert-layout lays out a PEFT adapter's routed experts", "needs --hf-export DIR"],
        ),
        (["--lora-rank", "4", "--hf-export-expert-layout", "stacked"], ["invalid choice: 'stacked'"]),
    ],
)
def test_bad_lora_flags_name_the_flag(checkpoints, capsys, flags, needles):
    err = _refused(capsys, [SCRIPT, "--hf-model", str(checkpoints("qwen3")), *flags])
    for needle in needles:
        assert needle in err, err


def test_input_errors_are_one_line_exit_2(tmp_path, capsys):
    assert "--hf-model DIR is required" in _refused(capsys, [SCRIPT, "--lora-rank", "4"])
    assert "usage: python -m twinkle_specs.launch" in _refused(capsys, ["--hf-model", "x"])
    err = _refused(capsys, [SCRIPT, "--hf-model", str(tmp_path / "missing")])
    assert f"{tmp_path / 'missing' / 'config.json'} not found" in err
    (tmp_path / "file").write_text("x")
    assert f"{tmp_path / 'file' / 'config.json'} not found" in _refused(
        capsys, [SCRIPT, "--hf-model", str(tmp_path / "file")]
    )
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"hidden_size": 64,\n  "num_layers": }\n')
    err = _refused(capsys, [SCRIPT, "--hf-model", str(tmp_path / "bad")])
    assert f"{tmp_path / 'bad' / 'config.json'} is not valid JSON" in err and "line 2" in err, err


def test_config_error_is_recorded_for_the_batch_script(tmp_path, capsys, monkeypatch):
    marker = tmp_path / "config-error.txt"
    monkeypatch.setenv("TWINKLE_CONFIG_ERROR_FILE", str(marker))
    _refused(capsys, [SCRIPT, "--lora-rank", "4"])
    assert marker.read_text() == "--hf-model DIR is required (a Hugging Face Qwen checkpoint)\n"


def test_megatron_parser_refusal_is_a_config_error(checkpoints, tmp_path):
    """A flag Megatron's parser rejects (argparse: exit 2, its own message) is recorded as a config error."""
    marker = tmp_path / "config-error.txt"
    env = dict(
        os.environ,
        PYTHONPATH=f"{STANDIN}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        TWINKLE_CONFIG_ERROR_FILE=str(marker),
        PYTHONWARNINGS="ignore",
    )
    cmd = [sys.executable, "-m", "twinkle_specs.launch", SCRIPT, "--hf-model", str(checkpoints("qwen3"))]
    cmd += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--no-such-flag"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 2, res.stderr
    assert "unrecognized arguments: --no-such-flag" in res.stderr, res.stderr
    assert "Megatron-LM's argument parser refused the command line" in marker.read_text()


def _launch_subprocess(args: list[str], marker: Path, **popen) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHONPATH=f"{STANDIN}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        TWINKLE_CONFIG_ERROR_FILE=str(marker),
        PYTHONWARNINGS="ignore",
        PYTHONDONTWRITEBYTECODE="1",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
    )
    cmd = [sys.executable, "-m", "twinkle_specs.launch", SCRIPT, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, **popen)


def _file_size_limit(limit: int):
    import resource

    def set_limit() -> None:  # Python ignores SIGXFSZ: a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return set_limit


# After training (False) the export is twinkle-specs' own, on one leg; inside megatron's save (True), both legs.
@pytest.mark.parametrize("on_save", [pytest.param(False, marks=pytest.mark.one_leg), True])
def test_export_write_failure_is_one_line_exit_2(checkpoints, tmp_path, on_save):
    """A --hf-export that passed the check before training but cannot be written at its end (full disk,
    quota, size limit: here a 300 kB file size limit against 0.7 MB of weights) is a configuration error
    naming the path and the system's reason, not a traceback; nothing is published."""
    marker, out = tmp_path / "config-error.txt", tmp_path / "hf-out"
    args = ["--hf-model", str(checkpoints("qwen3")), "--tokenizer-type", "NullTokenizer"]
    args += ["--vocab-size", "255", "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1"]
    args += ["--lr", "0.01", "--save", str(tmp_path / "ck"), "--save-interval", "1", "--hf-export", str(out)]
    args += ["--hf-export-on-save"] if on_save else []
    res = _launch_subprocess(args, marker, preexec_fn=_file_size_limit(300_000))
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    (line,) = [x for x in res.stderr.splitlines() if x.startswith("twinkle_specs.launch: error: ")]
    assert "--hf-export: writing the export failed: " in line, line
    assert str(out) in line and "File too large" in line and "(EFBIG)" in line and "ulimit -f" in line, line
    assert marker.read_text().startswith("--hf-export: writing the export failed: ")
    assert not any(out.rglob("*.safetensors")), sorted(out.rglob("*"))


def _config_error(args: list[str], tmp_path: Path) -> str:
    """The launcher run on ``args`` in a subprocess: exit 2 without a traceback; the recorded config error."""
    marker = tmp_path / "config-error.txt"
    res = _launch_subprocess(args, marker)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    return marker.read_text()


def test_architecture_conflict_after_megatron_parse_is_a_config_error(checkpoints, tmp_path):
    """A flag that only Megatron's parsed args show to contradict the checkpoint: exit 2 and recorded."""
    args = ["--hf-model", str(checkpoints("qwen2")), "--tokenizer-type", "NullTokenizer"]
    args += ["--vocab-size", "255", "--untie-embeddings-and-output-weights"]
    assert _config_error(args, tmp_path).startswith("--untie-embeddings-and-output-weights gives ")


def test_flash_attn_4_without_the_package_is_a_config_error(checkpoints, tmp_path):
    """``--flash-attn-4`` where FlashAttention-4 is not installed (this machine): refused once Megatron has
    parsed, before any model is built, naming the flag and the extra."""
    args = ["--hf-model", str(checkpoints("qwen3")), "--tokenizer-type", "NullTokenizer"]
    args += ["--vocab-size", "255", "--flash-attn-4"]
    assert _config_error(args, tmp_path) == (
        "--flash-attn-4 needs FlashAttention-4, which is not installed: "
        "pip install 'twinkle-specs[flash-attn-4]', or drop --flash-attn-4\n"
    )


def test_per_expert_export_the_model_cannot_take_is_refused_before_training(checkpoints, tmp_path):
    """Qwen3-MoE's HF MLP names give its routed experts' gate_up rank 2r (as peft does), which transformers 4's
    per-expert names cannot carry at the adapter's r: refused when the model is built, not at the end of
    training, naming the flag and the Megatron targets that give rank r."""
    out = tmp_path / "adapter"
    args = ["--hf-model", str(checkpoints("qwen3_moe")), "--tokenizer-type", "NullTokenizer"]
    args += ["--vocab-size", "255", "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1"]
    args += ["--lr", "0.01", "--lora-rank", "4", "--lora-target", "all-linear", "--hf-export", str(out)]
    args += ["--hf-export-expert-layout", "per-expert"]
    text = _config_error(args, tmp_path)
    assert text.startswith(
        "--hf-export-expert-layout: expert_layout 'per-expert': routed experts must have"
    ), text
    assert "linear_fc1/linear_fc2 rank r" in text, text
    assert not out.exists()
