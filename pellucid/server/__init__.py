"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over one LLM: `pellucid serve`.

from pellucid.server import create_app
app = create_app(LLM(), api_key=None, model_name="smollm2-135m")
"""

from pellucid.server.app import create_app

__all__ = ["create_app"]
