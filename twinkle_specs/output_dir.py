"""How every writer (``convert``, ``export``, ``save_hf_weights``, ``export_peft_adapter``, the launcher's
``--hf-export``) puts a directory on disk without ever destroying data.

* The target is checked before anything is written: it must not be, contain, or lie inside a source
  (a checkpoint the writer reads from or must keep); a non-empty target is refused unless the caller
  says overwrite, and even then only when everything in it is what an earlier output of the same kind
  holds (``replaceable`` patterns) -- an overwrite never deletes files no writer of ours made.
* The output is written into a hidden directory beside the target and renamed into place once complete;
  an earlier output is swapped out atomically (``renameat2(RENAME_EXCHANGE)``) and deleted only then. A
  writer killed at any point leaves the target absent or exactly as it was, and no stale file of an
  earlier output survives beside the new one.
* Files and directories get the modes the umask gives a new file/directory: safetensors writes a
  ``0600`` temporary file and renames it into place, so its shards would otherwise be unreadable to
  colleagues on shared storage while config.json and the index are ``0644``.
* Distributed writers: global rank 0 checks and creates the staging directory and tells every rank
  (same error everywhere, or the staging path to write into); after a barrier rank 0 renames it.
"""

from __future__ import annotations

import ctypes
import errno
import fnmatch
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from .os_errors import os_error_line

_STAGING_TAG = ".incomplete-"
_REPLACED_TAG = ".replaced-"
# What an interrupted writer of ours leaves inside a directory it adds to (the --hf-export-on-save root).
_LEFTOVERS = (f".*{_STAGING_TAG}*", f".*{_REPLACED_TAG}*")


class OutputDirError(ValueError):
    """An output directory that cannot be written without risking data."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _relation(target: Path, source: Path) -> str | None:
    if target == source:
        return "is"
    if source in target.parents:
        return "is inside"
    if target in source.parents:
        return "contains"
    return None


def check_target(
    target: str | Path,
    *,
    sources: Mapping[str, str | Path | None],
    overwrite: bool,
    flag: str,
    force_hint: str,
    replaceable: Iterable[str],
    error: type[ValueError] = OutputDirError,
) -> Path:
    """Refuses a target that is, contains or lies inside a source (``sources``: how the user named each,
    e.g. ``--hf-model``, -> its path, existing or to be written; None entries are skipped), a non-directory, or a non-empty
    directory without ``overwrite`` or holding anything ``replaceable`` does not match, raising ``error``
    (the writer's own error type). Returns the resolved target."""
    path = Path(target).resolve()
    for name, source in sources.items():
        if source is None:
            continue
        relation = _relation(path, Path(source).resolve())
        if relation:
            raise error(
                f"{flag} {target}: {relation} {name} {source}; writing there could destroy the source: "
                f"choose an output directory outside it"
            )
    if path.exists() and not path.is_dir():
        raise error(f"{flag} {target}: exists and is not a directory; choose a directory")
    entries = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if entries and not overwrite:
        raise error(
            f"{flag} {target}: directory is not empty ({', '.join(entries[:3])}"
            f"{', ...' if len(entries) > 3 else ''}); choose a new directory or {force_hint} to replace it"
        )
    patterns = (*replaceable, *_LEFTOVERS)
    foreign = [e for e in entries if not any(fnmatch.fnmatchcase(e, p) for p in patterns)]
    if foreign:
        raise error(
            f"{flag} {target}: holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}, which no "
            f"earlier output of this kind writes; refusing to replace it: choose a new directory or remove them"
        )
    return path


def _make_staging(target: Path) -> Path:
    """A new directory beside ``target`` (same filesystem, so the final rename is atomic), made with
    ``os.mkdir`` so that it gets the umask's mode (mkdtemp would give 0700)."""
    for parent in target.parents:  # a file on the way: mkdir would say "File exists" about it
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(parent))
            break
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}{_STAGING_TAG}{uuid.uuid4().hex[:12]}"
    os.mkdir(staging)
    return staging


def _apply_umask_modes(staging: Path) -> None:
    """Gives everything under ``staging`` the mode a new file/directory gets under the umask: the staging
    directory was made that way, files take its bits without execute."""
    dir_mode = staging.stat().st_mode & 0o777
    for root, dirs, files in os.walk(staging):
        for d in dirs:
            os.chmod(os.path.join(root, d), dir_mode)
        for f in files:
            os.chmod(os.path.join(root, f), dir_mode & 0o666)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, f"cannot move {a} into place: {os.strerror(err)}", str(b))


def publish(staging: Path, target: Path) -> None:
    """Renames the complete ``staging`` directory to ``target``; an existing target is swapped out in one
    step and deleted afterwards."""
    _apply_umask_modes(staging)
    if not target.exists():
        os.rename(staging, target)
        return
    if _exchange(staging, target):
        shutil.rmtree(staging)  # now holds the earlier output
        return
    old = target.parent / f".{target.name}{_REPLACED_TAG}{uuid.uuid4().hex[:12]}"
    os.rename(target, old)
    os.rename(staging, target)
    shutil.rmtree(old)


@contextmanager
def staged_output(
    target: str | Path,
    *,
    sources: Mapping[str, str | Path | None] | None = None,
    overwrite: bool = False,
    flag: str = "out_dir",
    force_hint: str = "pass overwrite=True",
    replaceable: Iterable[str] = (),
    error: type[ValueError] = OutputDirError,
) -> Iterator[Path]:
    """Checks ``target`` (see :func:`check_target`), yields a staging directory to write the output into
    and publishes it when the block completes; on an error the staging directory is removed and the
    target is untouched. Collective when torch.distributed is initialised: call it on every rank; global
    rank 0 checks, creates and publishes, every rank gets the same staging path (or the same error)."""
    rank0 = not _distributed() or dist.get_rank() == 0
    outcome: tuple[str, str] = ("", "")
    if rank0:
        try:
            resolved = check_target(
                target,
                sources=sources or {},
                overwrite=overwrite,
                flag=flag,
                force_hint=force_hint,
                replaceable=replaceable,
                error=error,
            )
            outcome = ("ok", str(_make_staging(resolved)))
        except (error, OSError) as err:
            outcome = (
                "error",
                str(err) if isinstance(err, error) else f"{flag} {target}: {os_error_line(err)}",
            )
    if _distributed():
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if outcome[0] == "error":
        raise error(outcome[1])
    staging = Path(outcome[1])
    try:
        yield staging
        if _distributed():
            dist.barrier()  # every rank has written its part
        if rank0:
            publish(staging, resolved)
    except BaseException:
        if rank0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if _distributed():
        dist.barrier()  # nobody reads the target before it is in place
