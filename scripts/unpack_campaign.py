"""Unpack what a GPU campaign brought back (campaign.tgz) into this checkout, safely.

    .venv/bin/python scripts/unpack_campaign.py campaign.tgz

The archive comes from another machine, so nothing in it is trusted. Every member must be a plain
file under ``results/`` or ``notebooks/`` (no absolute path, no ``..``, no link, no device), of a
kind the site uses (``.json``, ``.svg``, ``.png``, ``.pickle``, ``.ipynb``), and every results JSON
must have the shape of a results file (``labkit.provenance.check_results``). One bad member refuses
the whole archive before anything is written; then each file is written all or nothing.
"""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from labkit import cli
from labkit.config import UsageError, check_fields, option
from labkit.files import write_bytes
from labkit.provenance import check_results

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {"results": {".json", ".svg", ".png", ".pickle"}, "notebooks": {".ipynb"}}
MAX_BYTES = 64 << 20


@dataclass
class Config:
    """Unpack a GPU campaign's archive into results/ and notebooks/, refusing anything else."""

    archive: Path = option(Path("campaign.tgz"), "the archive scripts/gpu_campaign wrote", positional=True, path="read")

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.archive.is_file():
            raise UsageError(f"{self.archive}: no such file")


def checked_members(archive: Path) -> list[tuple[PurePosixPath, bytes]]:
    """Every member's path and bytes, or a UsageError naming the first member that is refused."""
    try:
        tar = tarfile.open(archive, "r:gz")
    except (tarfile.TarError, OSError) as err:
        raise UsageError(f"{archive}: not a readable .tgz ({err})") from None
    out = []
    with tar:
        for member in tar.getmembers():
            path = PurePosixPath(member.name)
            if member.isdir():
                continue
            where = f"{archive}: {member.name!r}"
            if not member.isfile():
                raise UsageError(f"{where} is not a plain file (a link or a device): refused")
            if path.is_absolute() or ".." in path.parts or len(path.parts) < 2 or path.parts[0] not in ALLOWED:
                raise UsageError(f"{where} lies outside results/ and notebooks/: refused")
            if path.suffix not in ALLOWED[path.parts[0]]:
                raise UsageError(f"{where}: a {path.suffix or 'suffix-less'} file has no place in {path.parts[0]}/")
            if member.size > MAX_BYTES:
                raise UsageError(f"{where} is {member.size:,} B, over the {MAX_BYTES:,} B a results file may be")
            data = tar.extractfile(member).read()
            if path.suffix == ".json":
                try:
                    check_results(json.loads(data))
                except ValueError as err:  # JSONDecodeError is one
                    raise UsageError(f"{where} is not a valid results file: {err}") from None
            out.append((path, data))
    return out


def run(config: Config) -> list[str]:
    members = checked_members(config.archive)  # all checked before anything is written
    for path, data in members:
        target = ROOT / Path(*path.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(target, data)
    return [str(p) for p, _ in members]


def report(written: list[str]) -> None:
    print(f"unpacked {len(written)} file(s): " + (", ".join(written[:8]) + (" ..." if len(written) > 8 else "")))


if __name__ == "__main__":
    cli.main(Config, run, report)
