"""Names a tenant chooses that end up in a path or URL: one rule, checked where they enter.

A checkpoint's name becomes the last segment of its `tinker://` path and a part of its
blob's key in the state-store. Restricting it to a small alphabet means no name can
carry a separator, a URL fragment or query (`#`, `?`), a percent-escape or a `.`/`..`
segment, so no name can address another object however it is joined or quoted.
"""

from __future__ import annotations

import re

MAX_NAME_CHARS = 200
NAME_ALPHABET = "letters, digits, '_', '.' and '-'"
_NAME = re.compile(rf"[A-Za-z0-9_][A-Za-z0-9_.-]{{0,{MAX_NAME_CHARS - 1}}}")


class BadNameError(ValueError):
    """A chosen name outside the rule; the message says what is allowed."""


def check_name(name: str, what: str = "checkpoint name") -> str:
    """`name` when it is allowed, else BadNameError saying what to change."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise BadNameError(
            f"{what} {name!r} is not allowed: use 1 to {MAX_NAME_CHARS} of {NAME_ALPHABET}, "
            "starting with a letter, a digit or '_'"
        )
    return name


__all__ = ["MAX_NAME_CHARS", "NAME_ALPHABET", "BadNameError", "check_name"]
