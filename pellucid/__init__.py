"""pellucid: an LLM engine you can see through."""
