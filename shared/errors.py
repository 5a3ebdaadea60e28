"""Errors that a user fixes by starting pdserve differently.

The CLI prints such an error as one line (``pdserve <command>: <message>``) and exits with status
2, instead of a traceback: the message already names the file and the problem, and a stack of
loader internals would only bury it.
"""

from __future__ import annotations


class StartupError(RuntimeError):
    """Bad start-up input: a model path that is not a model, a corrupt weights file, a missing
    package. The message must say what is wrong and, where it can, how to fix it."""


class ModelLoadError(StartupError):
    """A model that cannot be served; the message names the file (and the tensor, if one)."""
