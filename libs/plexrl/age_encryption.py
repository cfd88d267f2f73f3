"""age encryption (filippo.io/age, through pyrage) of exported files.

A recipient is a native X25519 key (`age1...`) or an SSH public key (`ssh-ed25519 ...`,
`ssh-rsa ...`), as `age -r` takes them; each file is one age stream (binary, not
armored) that `age -d -i <identity>` opens. The gateway parses the recipients when the
call comes in, so a bad key is the caller's 400 at once, not a failed save later.
"""

from __future__ import annotations

from typing import TypeAlias

import pyrage
from pyrage import ssh, x25519

AGE_SUFFIX = ".age"
"""What an encrypted file's name ends with."""

MAX_RECIPIENTS = 10
"""The Tinker API's bound on recipients per export."""

Recipient: TypeAlias = x25519.Recipient | ssh.Recipient


class RecipientError(ValueError):
    """A recipient string that is not an age or SSH public key; says which and why."""


def parse_recipients(texts: list[str]) -> list[Recipient]:
    """Every recipient parsed; RecipientError naming the first bad one."""
    if len(texts) > MAX_RECIPIENTS:
        raise RecipientError(
            f"{len(texts)} age recipients given; encrypt to at most {MAX_RECIPIENTS}"
        )
    return [parse_recipient(text) for text in texts]


def parse_recipient(text: str) -> Recipient:
    key = text.strip()
    try:
        if key.startswith("age1"):
            return x25519.Recipient.from_str(key)
        if key.startswith(("ssh-", "ecdsa-", "sk-")):
            return ssh.Recipient.from_str(key)
    except pyrage.RecipientError as exc:
        raise RecipientError(f"age recipient {_short(key)!r} is not a valid key: {exc}") from None
    raise RecipientError(
        f"age recipient {_short(key)!r} is neither a native age key ('age1...') nor an SSH "
        "public key ('ssh-ed25519 ...', 'ssh-rsa ...')"
    )


def encrypt_files(files: dict[str, bytes], recipients: list[Recipient]) -> dict[str, bytes]:
    """Each file encrypted to every recipient, named with the `.age` suffix."""
    return {name + AGE_SUFFIX: pyrage.encrypt(data, recipients) for name, data in files.items()}


def _short(key: str) -> str:
    return key if len(key) <= 40 else key[:37] + "..."
