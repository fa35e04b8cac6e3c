"""bench/telemetry.py: nvidia-smi's readings per timed step (parsing, step windows, the sampler process,
the report's table). The sampler runs a stand-in ``nvidia-smi`` script here; the device runs the real one."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest

from bench.report import telemetry_lines
from bench.telemetry import FIELD_SETS, Sample, Sampler, decode_reasons, parse_line, per_step, summary

# The harness's nvidia-smi telemetry, pure Python (no megatron-core code): one leg of scripts/test.sh
# (pyproject.toml's one_leg marker).
pytestmark = pytest.mark.one_leg


def test_parse_line_reads_nvidia_smi_csv_and_rejects_the_rest():
    s = parse_line("1755, 2619, 651.27, 63, 0x0000000000000004\n", 2.5)
    assert s == Sample(2.5, 1755.0, 2619.0, 651.27, 63.0, 0x4)
    assert parse_line("[N/A], 2619, 651.27, 63, 0x0000000000000004", 0.0) is None
    assert parse_line('Field "power.draw.instant" is not a valid field to query.', 0.0) is None
    assert parse_line("1755, 2619, 651.27, 63", 0.0) is None


def test_decode_reasons_names_bits_and_keeps_unknown_ones():
    assert decode_reasons(0) == []
    assert decode_reasons(0x4 | 0x20) == ["sw_power_cap", "sw_thermal_slowdown"]
    assert decode_reasons(0x1 | 0x1000) == ["gpu_idle", "0x1000"]


def test_per_step_averages_the_samples_inside_each_window():
    samples = [
        Sample(0.00, 1980, 2619, 300, 40, 0x0),
        Sample(0.02, 1900, 2619, 500, 41, 0x0),
        Sample(0.04, 1700, 2619, 690, 45, 0x4),
        Sample(0.06, 1650, 2619, 700, 47, 0x4 | 0x20),
    ]
    steps = per_step(samples, [(0.0, 0.03), (0.035, 0.07), (0.08, 0.09)])
    assert steps[0]["samples"] == 2 and steps[0]["sm_mhz"] == 1940 and steps[0]["power_w"] == 400
    assert steps[0]["reasons"] == {}
    assert steps[1]["sm_mhz"] == 1675 and steps[1]["temp_c"] == 47
    assert steps[1]["reasons"] == {"sw_power_cap": 1.0, "sw_thermal_slowdown": 0.5}
    assert steps[2] is None  # no sample fell in it


def _stand_in(tmp_path: Path) -> Path:
    """An ``nvidia-smi`` that refuses the first field set (as drivers without ``power.draw.instant`` do),
    answers the second once, and in loop mode prints a reading every 10 ms until terminated; it logs
    its arguments."""
    script = tmp_path / "nvidia-smi"
    script.write_text(
        "#!/bin/bash\n"
        f'echo "$*" >> {tmp_path}/args.log\n'
        'case "$*" in *power.draw.instant*) '
        "echo 'Field \"power.draw.instant\" is not a valid field to query.'; exit 2;; esac\n"
        'case "$*" in *--loop-ms*) while true; do echo "1755, 2619, 650.5, 61, 0x0000000000000004"; '
        "sleep 0.01; done;; esac\n"
        'echo "1980, 2619, 80.1, 40, 0x0000000000000001"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_sampler_picks_the_field_set_the_driver_answers_and_samples_until_stopped(tmp_path):
    script = _stand_in(tmp_path)
    sampler = Sampler("GPU-1234", period_ms=10, binary=str(script)).start()
    assert sampler.error is None and sampler.fields == FIELD_SETS[1]
    assert sampler.samples, "start() returns once the loop's first reading is in"
    t0 = sampler.samples[0].t
    time.sleep(0.2)
    samples = sampler.stop()
    assert sampler._proc.poll() is not None  # the loop is gone
    assert len(samples) >= 5 and all(s.sm_mhz == 1755 and s.reasons == 0x4 for s in samples)
    got = summary(sampler, [(t0, samples[-1].t), (samples[-1].t + 10, samples[-1].t + 11)])
    assert got["available"] and got["steps_with_samples"] == 1 and got["per_step"][1] is None
    assert got["sm_mhz_median"] == 1755 and got["reason_share"] == {"sw_power_cap": 1.0}
    args = (tmp_path / "args.log").read_text().splitlines()
    assert all(a.startswith("-i GPU-1234 --query-gpu=") for a in args)
    assert args[-1].endswith("--loop-ms=10")


def test_sampler_without_nvidia_smi_says_why_and_times_on(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    sampler = Sampler("0").start()
    assert sampler.stop() == []
    got = summary(sampler, [(0.0, 1.0)])
    assert got == {"available": False, "reason": "nvidia-smi not found on PATH"}


def test_sampler_reports_a_driver_that_answers_no_field_set(tmp_path):
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/bash\necho 'NVIDIA-SMI has failed because it could not communicate'; exit 9\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    sampler = Sampler("0", binary=str(script)).start()
    assert (
        sampler.fields is None and "answered 9" in sampler.error and "could not communicate" in sampler.error
    )
    assert not summary(sampler, [])["available"]


def test_report_tables_the_clocks_and_names_what_was_not_sampled():
    sampled = {
        "status": "ok",
        "shape": "qwen3-8b",
        "variant": "twinkle_lora",
        "tag": "s18",
        "gpu_telemetry": {
            "available": True,
            "steps_with_samples": 2,
            "per_step": [{"sm_mhz": 1980.0}, {"sm_mhz": 1702.4}, None],
            "sm_mhz_median": 1841.2,
            "power_w_median": 688.0,
            "temp_c_max": 71.0,
            "reason_share": {"gpu_idle": 0.05, "sw_power_cap": 0.875},
        },
    }
    older = {  # recorded before the shares were kept: the names seen
        "status": "ok",
        "shape": "qwen3-1.7b",
        "variant": "hf_peft_lora",
        "gpu_telemetry": {
            "available": True,
            "steps_with_samples": 1,
            "per_step": [{"sm_mhz": 1950.0}],
            "sm_mhz_median": 1950.0,
            "power_w_median": 640.0,
            "temp_c_max": 50.0,
            "reasons_seen": ["sw_power_cap"],
        },
    }
    unsampled = {
        "status": "ok",
        "gpu_telemetry": {"available": False, "reason": "nvidia-smi not found on PATH"},
    }
    lines = telemetry_lines([sampled, older, unsampled, {"status": "error"}])
    row = next(line for line in lines if line.startswith("| qwen3-8b"))
    assert row == (
        "| qwen3-8b | twinkle_lora [s18] | 2/3 | 1841 | 1702–1980 | 688 | 71 | gpu_idle 5%, sw_power_cap 88% |"
    )
    assert next(line for line in lines if line.startswith("| qwen3-1.7b")).endswith("| 50 | sw_power_cap |")
    assert lines[-1] == "- not sampled: nvidia-smi not found on PATH"
    assert telemetry_lines([{"status": "ok"}]) == []


def test_harness_times_without_a_sampler_on_cpu():
    """On CPU the timing loop starts no sampler and records no telemetry (nothing to sample)."""
    import torch

    from bench.timing import time_steps

    timed = time_steps(lambda: torch.tensor(1.0), 1, 2)
    assert "gpu_telemetry" not in timed and len(timed["step_time_s"]["all"]) == 2
