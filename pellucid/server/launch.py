"""ServeOptions and build_app: what `pellucid serve` builds, in one process or in each replica.

    app, name = build_app(ServeOptions(model="smollm2-135m"))

The single-process server (serve.py) and every Ray Serve replica (replicas.py) build the same
app from the same options, so a replica answers exactly as `pellucid serve` alone would.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from fastapi import FastAPI

from pellucid import catalog
from pellucid.config import EngineConfig
from pellucid.llm import LLM
from pellucid.server.app import create_app
from pellucid.server.limits import ServerLimits


@dataclass(frozen=True)
class ServeOptions:
    model: str | None = None  # a catalog name, GGUF file or HF folder (None: the default)
    dtype: str = "int4"
    compile: bool = False  # torch.compile the decode step, compiled before serving
    max_model_len: int | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    limits: ServerLimits = field(default_factory=ServerLimits)
    api_key: str | None = None
    sampling_defaults: str = "model"  # "model": the model's recommended sampling; "openai"

    def served_name(self, llm: LLM) -> str:
        entry = catalog.find(self.model or catalog.DEFAULT_MODEL)
        return entry.name if entry is not None else llm.path.name


def build_app(opts: ServeOptions) -> tuple[FastAPI, str]:
    """Load the model and wrap it in the OpenAI-compatible app; returns the app and its name."""
    llm = LLM(
        opts.model,
        dtype=opts.dtype,
        max_model_len=opts.max_model_len,
        engine=opts.engine,
        compile=opts.compile,
    )
    if opts.compile:
        print(
            "Compiling the decode step (tens of seconds the first time, then cached)...",
            file=sys.stderr,
        )
        llm.warm_up()
    if opts.sampling_defaults == "openai":
        llm.sampling_defaults = {}
    name = opts.served_name(llm)
    return create_app(llm, api_key=opts.api_key, model_name=name, limits=opts.limits), name
