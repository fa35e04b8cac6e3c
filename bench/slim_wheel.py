"""Repack a wheel without some of its files, under a local version label (PEP 440 "+label"), so that the
result is never mistaken for the upstream wheel. Kept files are copied byte for byte; METADATA's Version,
the .dist-info folder name and RECORD (sha256 and sizes) are rewritten to match.

Used for the kit's bitsandbytes: upstream's 43 MB wheel carries native libraries for every CUDA, ROCm and
XPU version; the device image is torch 2.11.0+cu130, which loads libbitsandbytes_cuda130.so (cextension.py
picks the library by torch.version.cuda), so only that one and the CPU library are kept:

    python3 slim_wheel.py bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl cu130.slim \
        'bitsandbytes/libbitsandbytes_cuda1[0-2]*.so' 'bitsandbytes/libbitsandbytes_cuda132.so' \
        'bitsandbytes/libbitsandbytes_rocm*.so' 'bitsandbytes/libbitsandbytes_xpu*.so'
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import sys
import zipfile
from pathlib import Path


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def slim(wheel: Path, label: str, drop: list[str]) -> Path:
    name, version, *tags = wheel.name[: -len(".whl")].split("-")
    new_version = f"{version}+{label}"
    old_info, new_info = f"{name}-{version}.dist-info", f"{name}-{new_version}.dist-info"
    out = wheel.with_name("-".join([name, new_version, *tags]) + ".whl")
    record: list[str] = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            path = info.filename
            if path == f"{old_info}/RECORD" or any(fnmatch.fnmatch(path, pattern) for pattern in drop):
                continue
            data = src.read(info)
            if path == f"{old_info}/METADATA":
                data = data.replace(
                    f"\nVersion: {version}\n".encode(), f"\nVersion: {new_version}\n".encode(), 1
                )
            if path.startswith(old_info + "/"):
                path = new_info + path[len(old_info) :]
            item = zipfile.ZipInfo(path, date_time=info.date_time)
            item.external_attr, item.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
            dst.writestr(item, data)
            record.append(f"{path},{_record_hash(data)},{len(data)}")
        record.append(f"{new_info}/RECORD,,")
        dst.writestr(f"{new_info}/RECORD", "\n".join(record) + "\n")
    return out


if __name__ == "__main__":
    print(slim(Path(sys.argv[1]), sys.argv[2], sys.argv[3:]))
