"""The package imports from a source checkout put first on sys.path (bench/run.py does, as does
``PYTHONPATH=$REPO``), where ``twinkle_specs/patches`` does not exist: pyproject maps the top-level
``patches/`` folder to ``twinkle_specs.patches`` only in an install."""

from __future__ import annotations

import json
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
sys.path[:0] = sys.argv[1:2]
sys.path += sys.argv[2:]  # site-packages without its .pth files (python -S): no install of ours maps names
import twinkle_specs
from twinkle_specs.patches import rope_on_host
print(json.dumps({"package": twinkle_specs.__file__, "patches": sys.modules["twinkle_specs.patches"].__file__,
                  "rope": rope_on_host.__file__, "applied": twinkle_specs.patches.apply_all()}))
"""


def test_source_checkout_first_on_sys_path_loads_the_repo_patches(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-S", "-c", PROBE, str(ROOT), *site.getsitepackages()],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(seen["package"]) == ROOT / "twinkle_specs" / "__init__.py"
    assert Path(seen["patches"]) == ROOT / "patches" / "__init__.py"
    assert Path(seen["rope"]) == ROOT / "patches" / "rope_on_host.py"
    assert isinstance(seen["applied"], list)
