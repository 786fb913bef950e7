"""pellucid: an LLM engine you can see through."""

from pellucid.engine.outputs import RequestOutput
from pellucid.engine.sampling_params import SamplingParams
from pellucid.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
