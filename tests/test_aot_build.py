"""The decode step built in a background process for a model without one (engine/aot_build.py):
one build per package, at the lowest priority; a failed one is not started again. A real build
takes minutes (test_engine builds real packages in-process, and switches an engine to one
written while it ran): here a stand-in command writes the package or does not, and the real
command fails at once on a missing file."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from pellucid import LLM
from pellucid.engine import aot_build, aot_decode

# what the stand-in build writes into the package: the switch it was given
WRITE = (
    "import os, sys, time; time.sleep(float(sys.argv[2])); "
    "open(sys.argv[1], 'w').write(os.environ['PELLUCID_BUILD_AHEAD'])"
)


def stand_in(monkeypatch: pytest.MonkeyPatch, package: Path | None, seconds: float) -> None:
    """aot_build's command replaced: wait `seconds`, then write `package` (None: write nothing,
    as a build that fails)."""
    code = WRITE if package is not None else "import sys, time; time.sleep(float(sys.argv[2]))"
    target = str(package or "")
    monkeypatch.setattr(
        aot_build, "command", lambda _: [sys.executable, "-c", code, target, str(seconds)]
    )


def niceness(pid: int) -> int | None:
    """The process's niceness from /proc (field 19 of its stat), None once it has ended."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[16])


def wait_for(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the stand-in build did not end"
        time.sleep(0.05)


def test_one_build_per_package(tmp_path, monkeypatch):
    package = tmp_path / "aot" / "decode-few-rows-x.pt2"
    stand_in(monkeypatch, package, 1.0)
    assert aot_build.start(Path("model.gguf"), package)
    lock = aot_build.lock_of(package)
    pid = lock.read_text()
    assert pid and aot_build.builder_alive(lock)
    assert aot_build.start(Path("model.gguf"), package)  # already building: not a second one
    assert lock.read_text() == pid
    wait_for(package.exists)
    assert package.read_text() == "0"  # the build starts no build of its own
    wait_for(lambda: not aot_build.builder_alive(lock))
    assert not aot_build.start(Path("model.gguf"), package)  # built: nothing to do
    assert not lock.exists()


def test_a_failed_build_ran_at_the_lowest_priority_and_is_not_started_again(tmp_path, caplog):
    """The real command, for a model file that does not exist: `pellucid compile` fails (its
    error in the build's log), and the next start warns instead of building again."""
    package, missing = tmp_path / "aot" / "decode-few-rows-y.pt2", tmp_path / "missing.gguf"
    assert aot_build.start(missing, package)
    lock = aot_build.lock_of(package)
    pid = int(lock.read_text())
    seen = set()
    while aot_build.builder_alive(lock):
        seen.add(niceness(pid))
        time.sleep(0.01)
    assert aot_build.NICE in seen  # set by the build itself, before it imports pellucid
    assert "nor an existing GGUF file" in aot_build.log_of(package).read_text()
    assert not aot_build.start(missing, package)
    assert f"pellucid compile --model {missing}" in caplog.text
    assert lock.exists() and not package.exists()
    lock.write_text("not a pid")  # a damaged lock reads as a build that has ended
    assert not aot_build.builder_alive(lock)


def test_a_fast_path_load_without_a_package_starts_its_build(tiny_path, tmp_path, monkeypatch):
    """LLM() on the fast path, with no few-row package for the model: the build starts, the
    engine decodes eagerly and looks for the package; off (PELLUCID_BUILD_AHEAD=0, as the
    tests run) or with dtype="float32", nothing starts."""
    monkeypatch.setattr(aot_decode, "cache_root", lambda: tmp_path)  # packages only (not kernels)
    stand_in(monkeypatch, None, 5.0)
    llm = LLM(tiny_path)  # the suite's default: off
    package = aot_decode.package_paths(llm.model)[1]
    assert llm.engine.model_runner.compiled_decode is None
    assert not aot_build.lock_of(package).exists()
    monkeypatch.setenv("PELLUCID_BUILD_AHEAD", "1")
    LLM(tiny_path, dtype="float32")
    assert not list(tmp_path.rglob("*.building"))
    llm = LLM(tiny_path)
    assert aot_build.lock_of(package).exists()
    decode = llm.engine.model_runner.compiled_decode
    assert decode is not None and decode.refresh is not None and decode.ahead == {}
    assert llm.generate([[1, 2, 3]])[0].token_ids  # eagerly meanwhile
    os.kill(int(aot_build.lock_of(package).read_text()), 9)
