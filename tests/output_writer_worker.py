"""A writer that blocks right after its first file is on disk (so a test can SIGKILL it mid-write).

    python output_writer_worker.py {hf|peft} HF_DIR OUT {0|1 overwrite} MARKER

The writer's own ``save_file`` is wrapped: it writes, records the path in MARKER and sleeps.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import twinkle_specs as ts
from twinkle_specs import export as hf_writer
from twinkle_specs.lora import peft_io
from twinkle_specs.parity import _init_single_process


def main() -> None:
    kind, hf, out, overwrite, marker = sys.argv[1:6]
    module = hf_writer if kind == "hf" else peft_io
    real = module.save_file

    def save_then_block(tensors, path, *args, **kwargs):
        real(tensors, path, *args, **kwargs)
        Path(marker).write_text(str(path))
        time.sleep(600)

    module.save_file = save_then_block
    _init_single_process()
    if kind == "hf":
        ts.save_hf_weights(ts.build_model(hf), out, max_shard_bytes=100_000, overwrite=overwrite == "1")
    else:
        lora = ts.LoraConfig(r=4, lora_alpha=8, target_modules=("all-linear",))
        ts.export_peft_adapter(ts.build_model(hf, lora=lora), out, overwrite=overwrite == "1")


if __name__ == "__main__":
    main()
