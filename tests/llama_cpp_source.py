"""llama.cpp's own converter (convert_hf_to_gguf.py) and tokenizer tests (models/ggml-vocab-*:
vocabulary-only GGUFs with their .inp texts and .out ids), fetched at test time from the package
index: the llama-cpp-python source archive vendors llama.cpp, converter and gguf-py included.
Nothing of it is kept in this repository; the archive is downloaded once into pellucid's cache."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

VERSION = "0.3.36"  # the llama-cpp-python the references here were made with
ARCHIVE = f"llama_cpp_python-{VERSION}.tar.gz"
ROOT = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
# what the converter needs, and the tokenizer tests' vocabularies (with chat templates: 8 MB)
PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/")


def source_dir() -> Path:
    """The folder holding llama.cpp's parts, downloaded and unpacked where one is missing;
    the test is skipped where the package index cannot be reached."""
    cache = Path(
        os.environ.get("PELLUCID_TEST_CACHE", Path.home() / ".cache" / "pellucid" / "test")
    )
    folder = cache / f"llama.cpp-{VERSION}"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "llama.cpp.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one test process unpacks, the others wait for it
        if not all((folder / part).exists() for part in PARTS):
            unpack(cache, folder)
    return folder


def unpack(cache: Path, folder: Path) -> None:
    """Download the archive and unpack PARTS into `folder`, whole or not at all: they are
    unpacked beside it and moved into place, so a test stopped halfway leaves no half folder."""
    download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    download += ["--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d", str(cache)]
    if subprocess.run(download, check=False, capture_output=True, timeout=600).returncode:
        pytest.skip(f"llama-cpp-python {VERSION}'s source could not be downloaded")
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(cache / ARCHIVE) as archive:
        members = [
            m for m in archive.getmembers() if m.name.startswith(tuple(ROOT + p for p in PARTS))
        ]
        for m in members:
            m.name = m.name.removeprefix(ROOT)
        archive.extractall(partial, members=members, filter="data")
    (cache / ARCHIVE).unlink()
    shutil.rmtree(folder, ignore_errors=True)  # an older unpacking, with fewer parts
    partial.rename(folder)


# Runs the converter as its command line does, once per (folder, out) pair, in one process: its
# imports (torch, transformers, its own gguf-py) take seconds, paid once for all the pairs
CONVERT_MANY = """
import runpy, sys
script, pairs = sys.argv[1], sys.argv[2:]
for folder, out in zip(pairs[::2], pairs[1::2]):
    sys.argv = [script, folder, "--outfile", out, "--outtype", "f32"]
    runpy.run_path(script, run_name="__main__")
"""


def convert(*pairs: tuple[Path, Path]) -> list[Path]:
    """F32 GGUFs of Hugging Face folders, each (folder, out) made by llama.cpp's converter with
    its own gguf-py (in a process of its own: pellucid reads GGUFs with the gguf package)."""
    folder = source_dir()
    command = [sys.executable, "-c", CONVERT_MANY, str(folder / "convert_hf_to_gguf.py")]
    command += [str(path) for pair in pairs for path in pair]
    # its gguf-py, and its folder (for its `conversion` package), as running the script would
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(folder / "gguf-py"), str(folder)])}
    done = subprocess.run(
        command, check=False, capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [out for _, out in pairs]


def vocab_files() -> list[Path]:
    """llama.cpp's tokenizer tests: each vocabulary-only GGUF that has .inp/.out files."""
    models = source_dir() / "models"
    return sorted(
        p for p in models.glob("ggml-vocab-*.gguf") if p.with_suffix(".gguf.inp").exists()
    )


def vocab_cases(vocab: Path) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs of a tokenizer test, read as llama.cpp's test-tokenizer-0 reads them:
    the texts are separated by a marker line, the ids are one line per text."""
    # read as bytes: text mode would turn a '\r' of the texts into '\n'
    raw = vocab.with_suffix(".gguf.inp").read_bytes().decode()
    texts = raw.split("\n__ggml_vocab_test__\n")
    if texts[-1] == "":  # the file ends with a marker
        texts.pop()
    lines = vocab.with_suffix(".gguf.out").read_bytes().decode().split("\n")
    assert len(lines) >= len(texts), f"{vocab.name}: fewer expected outputs than texts"
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]
