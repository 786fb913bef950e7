"""Errors a user can act on: each message says what was wrong and what to do about it."""


class PellucidError(Exception):
    """Base class: the CLI prints these as one line and exits non-zero."""


class ModelLoadError(PellucidError):
    """A model file or folder is missing, corrupt, or of a kind pellucid cannot load."""


class PromptError(PellucidError, ValueError):
    """A prompt is empty, malformed, or longer than the model's context."""
