"""llama.cpp's own converter (convert_hf_to_gguf.py), fetched at test time from the package index:
the llama-cpp-python source archive vendors llama.cpp, converter and gguf-py included. Nothing
of it is kept in this repository; the archive is downloaded once into pellucid's cache."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

VERSION = "0.3.36"  # the llama-cpp-python the references here were made with
ARCHIVE = f"llama_cpp_python-{VERSION}.tar.gz"
ROOT = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")  # what the converter needs


def converter_dir() -> Path:
    """The folder holding llama.cpp's converter, downloaded and unpacked where it is missing;
    the test is skipped where the package index cannot be reached."""
    cache = Path(
        os.environ.get("PELLUCID_TEST_CACHE", Path.home() / ".cache" / "pellucid" / "test")
    )
    folder = cache / f"llama.cpp-{VERSION}"
    if (folder / "convert_hf_to_gguf.py").is_file():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    download += ["--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d", str(cache)]
    if subprocess.run(download, check=False, capture_output=True, timeout=600).returncode:
        pytest.skip(f"llama-cpp-python {VERSION}'s source could not be downloaded")
    with tarfile.open(cache / ARCHIVE) as archive:
        members = [
            m for m in archive.getmembers() if m.name.startswith(tuple(ROOT + p for p in PARTS))
        ]
        for m in members:
            m.name = m.name.removeprefix(ROOT)
        archive.extractall(folder, members=members, filter="data")
    (cache / ARCHIVE).unlink()
    return folder


def convert(hf_folder: Path, out: Path) -> Path:
    """An F32 GGUF of a Hugging Face folder, made by llama.cpp's converter with its own gguf-py."""
    folder = converter_dir()
    command = [sys.executable, str(folder / "convert_hf_to_gguf.py"), str(hf_folder)]
    command += ["--outfile", str(out), "--outtype", "f32"]
    env = os.environ | {"PYTHONPATH": str(folder / "gguf-py")}
    done = subprocess.run(
        command, check=False, capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return out
