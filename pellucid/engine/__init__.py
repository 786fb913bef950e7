"""The engine: requests in, tokens out, one `LLMEngine.step()` at a time. What is named here is
its public face, which the layers above (the LLM, the server, the trace renderers) use."""

from pellucid.engine.llm_engine import LLMEngine
from pellucid.engine.outputs import EngineStats, RequestOutput, Timings, TokenLogprob
from pellucid.engine.probes import Intervention
from pellucid.engine.sampling_params import SamplingParams, TraceOptions
from pellucid.engine.trace_recorder import Recorder, model_info
from pellucid.engine.trace_records import Trace

__all__ = [
    "EngineStats",
    "Intervention",
    "LLMEngine",
    "Recorder",
    "RequestOutput",
    "SamplingParams",
    "Timings",
    "TokenLogprob",
    "Trace",
    "TraceOptions",
    "model_info",
]
