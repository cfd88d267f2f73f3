"""Errors of the SGLang sampler, each an EngineError so the worker reports its ErrorCode."""

from __future__ import annotations

from plexrl_worker.engine.errors import EngineError, EngineInputError


class SGLangUnsupportedError(EngineInputError):
    """A request SGLang cannot serve on this device; the message says what to change.
    A user error (bad_request, a 4xx at the gateway): retrying the same call cannot help."""


class SGLangServerError(EngineError):
    """The SGLang server would not start, died, or answered an operation with a failure."""
