"""Engine errors, each carrying the ErrorCode the worker reports for it."""

from __future__ import annotations

from plexrl.messages import ErrorCode


class EngineError(Exception):
    """Base of every error the engine raises on purpose; `code` goes into ErrorInfo."""

    code: ErrorCode = ErrorCode.INTERNAL


class EngineInputError(EngineError, ValueError):
    """The call's input is malformed; the message says what to change."""

    code = ErrorCode.BAD_REQUEST


class NotFoundError(EngineError, LookupError):
    """A base model or weight set this engine cannot find."""

    code = ErrorCode.NOT_FOUND

    def __str__(self) -> str:
        # LookupError would quote the message like a dict key.
        return str(self.args[0]) if self.args else ""


class UnknownJobError(NotFoundError):
    """The engine holds no state for this job (never created, dropped, or offloaded)."""

    def __init__(self, job_id: str, resident: list[str]) -> None:
        listing = ", ".join(resident) if resident else "none"
        super().__init__(
            f"no state for {job_id!r} on this engine (resident: {listing}); create it, "
            "or onload it if it was offloaded"
        )
        self.job_id = job_id


class JobExistsError(EngineError):
    """A job id that already has state; a worker bug (creates and onloads are not idempotent)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(
            f"{job_id!r} already has state on this engine; drop or offload it before "
            "creating or onloading it again"
        )
        self.job_id = job_id
