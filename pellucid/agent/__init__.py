"""Agent building blocks: tools a model can call (see pellucid.agent.tools)."""
