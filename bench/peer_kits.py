"""Where the LoRA peers' wheel kits are installed on the GPU machine, and how a peer's process finds its
own. ``bench/peers.sh install`` puts each kit in a folder of its own (``/tmp/gpu/peers/<kit>``, or
``$BENCH_PEER_KITS/<kit>``), not into the image's site-packages: a kit may pin another version of a library
the other variants share (mcore-bridge's peft 0.20) or patch libraries on import (Unsloth), so only the
variant that needs it puts its folder first on ``sys.path``, in its own child process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

STAGE = "bash bench/peers.sh stage (here), carry .gpu/peers, bash bench/peers.sh install (there)"


def flash_attn_4_missing() -> str | None:
    """Why FlashAttention-4 (the ``*_fa4`` variants' kit; not a peer's, so installed for every process) cannot be
    imported here, or None."""
    from twinkle_specs.flash_attention import installed

    if installed():
        return None
    return (
        "flash-attn-4 is not installed (pip install 'twinkle-specs[flash-attn-4]'; on the device: "
        "scripts/gpu/stage_fa4.sh and install_fa4.sh)"
    )


def kit_dir(kit: str) -> Path:
    return Path(os.environ.get("BENCH_PEER_KITS", "/tmp/gpu/peers")) / kit


def activate(kit: str) -> Path | None:
    """Puts ``kit``'s folder first on ``sys.path`` if it is installed; None where it is not (the library
    may still come from the environment)."""
    folder = kit_dir(kit)
    if not folder.is_dir():
        return None
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return folder
