"""The layers of the house, as pyproject.toml's [tool.importlinter] contracts state them: imports
point down (cli -> server/agent/train -> trace -> llm -> engine/loading -> structured ->
models/tokenizer -> weights), no package has an import cycle among its modules, and the server
and agent reach the engine through its public API only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    run = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert run.stdout.count(" KEPT") == 3, run.stdout[-2000:]
