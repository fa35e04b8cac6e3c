"""Which code a benchmark measured: the git commit, and a hash of the measured source files computed
from the tree that ran.

``source_sha256`` is the sha256 of the ``sha256sum`` listing of every ``.py`` file under
``twinkle_specs/``, ``patches/`` and ``bench/`` (``bench/results/`` left out), sorted by path, so anyone
can recompute it from a checkout::

    find twinkle_specs patches bench -name '*.py' -not -path 'bench/results/*' | LC_ALL=C sort \\
        | xargs sha256sum | sha256sum

The commit is git's HEAD when its sources hash to the tree's; else one written by ``bench/stage.sh`` (the
device machine's copy of the tree may have no ``.git``, or a stale one) or by an earlier call into the same
``--out`` whose hash is the tree's; else HEAD (or, without git, the staged commit) with " (modified)".
Nothing is taken from the environment. Standard library only: bench/stage.sh runs this file as a
script (``python3 bench/provenance.py`` prints a COMMIT file).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

SOURCE_DIRS = ("twinkle_specs", "patches", "bench")
EXCLUDED = "bench/results/"
MODIFIED = " (modified)"


def _measured(path: str) -> bool:
    return path.endswith(".py") and path.split("/")[0] in SOURCE_DIRS and not path.startswith(EXCLUDED)


def _digest(contents: dict[str, bytes]) -> str:
    listing = "".join(
        f"{hashlib.sha256(data).hexdigest()}  {path}\n" for path, data in sorted(contents.items())
    )
    return hashlib.sha256(listing.encode()).hexdigest()


def source_sha256(root: Path) -> str:
    """The measured sources' hash as the files in ``root`` are now."""
    files = [p for d in SOURCE_DIRS if (root / d).is_dir() for p in (root / d).rglob("*.py") if p.is_file()]
    paths = {p.relative_to(root).as_posix(): p for p in files}
    return _digest({rel: p.read_bytes() for rel, p in paths.items() if _measured(rel)})


def _git(root: Path, *args: str, stdin: bytes | None = None) -> bytes | None:
    try:
        proc = subprocess.run(["git", "-C", str(root), *args], input=stdin, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return proc.stdout


def source_sha256_at(root: Path, commit: str) -> str | None:
    """The measured sources' hash at ``commit`` of the git repository at ``root`` (None without git)."""
    listing = _git(root, "ls-tree", "-r", "-z", commit, "--", *SOURCE_DIRS)
    if listing is None:
        return None
    blobs = {}
    for entry in filter(None, listing.decode().split("\0")):
        meta, _, path = entry.partition("\t")
        _, kind, oid = meta.split()
        if kind == "blob" and _measured(path):
            blobs[path] = oid
    batch = _git(root, "cat-file", "--batch", stdin="".join(f"{oid}\n" for oid in blobs.values()).encode())
    if batch is None:
        return None
    contents: dict[str, bytes] = {}
    at = 0
    for path in blobs:  # each answer: "<oid> blob <size>\n<content>\n", in the order asked
        header_end = batch.index(b"\n", at)
        size = int(batch[at:header_end].split()[2])
        contents[path] = batch[header_end + 1 : header_end + 1 + size]
        at = header_end + 1 + size + 1
    return _digest(contents)


def git_head(root: Path) -> str | None:
    """HEAD of the git checkout at ``root``, with " (modified)" when the measured sources differ from it."""
    head = _git(root, "rev-parse", "--verify", "HEAD")
    if head is None:
        return None
    commit = head.decode().strip()
    return commit if source_sha256_at(root, commit) == source_sha256(root) else commit + MODIFIED


def read_commit_file(path: Path) -> tuple[str, str | None] | None:
    """A COMMIT file's commit and source hash (files without the hash line give None for it)."""
    if not path.is_file():
        return None
    lines = path.read_text().splitlines()
    if not lines or not lines[0].strip():
        return None
    sha = next((ln.split()[1] for ln in lines[1:] if ln.startswith("source_sha256 ")), None)
    return lines[0].strip(), sha


def commit_file_text(commit: str, sha: str) -> str:
    return f"{commit}\nsource_sha256 {sha}\n"


def provenance(root: Path, commit_files: list[Path]) -> dict[str, str | None]:
    """``git_commit`` and ``source_sha256`` of the tree at ``root`` (see the module doc). ``commit_files``
    are COMMIT files to fall back on, in order, where git gives no commit."""
    sha = source_sha256(root)
    commit = git_head(root)
    if commit is None or commit.endswith(MODIFIED):
        claims = [c for f in commit_files if (c := read_commit_file(f)) and c[1] is not None]
        verified = [c for c, claimed_sha in claims if claimed_sha == sha]
        if verified:  # also over a stale .git whose HEAD is not the tree that ran
            commit = verified[0]
        elif commit is None and claims:
            commit = claims[0][0].removesuffix(MODIFIED) + MODIFIED
    return {"git_commit": commit, "source_sha256": sha}


if __name__ == "__main__":
    here = Path(__file__).resolve().parents[1]
    found = provenance(here, [])
    if found["git_commit"] is None:
        sys.exit(f"{here}: not a git checkout; a COMMIT file needs the commit")
    sys.stdout.write(commit_file_text(found["git_commit"], found["source_sha256"]))
