"""One-line reports of failed file-system operations (read-only, full, missing, ...), shared by the CLI and
the launcher so that both name the path, the system's reason and what to do in the same words."""

from __future__ import annotations

import errno
import re
from pathlib import Path

# safetensors' writer reports an I/O failure as text: "... I/O error: No space left on device (os error 28)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")

_OS_HINTS = {
    "ENOSPC": "free space there or choose another directory",
    "EDQUOT": "free space there (quota) or choose another directory",
    "EFBIG": "the file size limit (ulimit -f) is too small",
    "EROFS": "the filesystem is read-only: choose a writable directory",
    "EACCES": "no permission: choose a directory you can write",
    "EPERM": "no permission: choose a directory you can write",
    "ENOTDIR": "a component of the path is a file, not a directory",
}


def os_error_line(err: Exception, path: str | Path | None = None) -> str:
    """One line naming the path, the system's reason and what to do. ``err`` is an OSError or a
    safetensors write error; ``path`` names the file or directory where ``err`` itself does not (a write
    to an open file, safetensors' writer). Without either, the error's own message (our own
    FileNotFoundErrors name the path already)."""
    if isinstance(err, OSError):
        number, reason = err.errno, err.strerror or str(err)
        filename, filename2 = err.filename, err.filename2
    else:
        match = _RUST_OS_ERROR.search(str(err))
        number, reason, filename, filename2 = int(match[1]) if match else None, str(err), None, None
    if filename is None:
        filename = path
    if filename is None:
        return str(err)
    where = f"{filename} -> {filename2}" if filename2 is not None else str(filename)
    code = errno.errorcode.get(number or 0, "")
    hint = _OS_HINTS.get(code, "")
    return f"{where}: {reason}{f' ({code})' if code else ''}{f'; {hint}' if hint else ''}"
