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
