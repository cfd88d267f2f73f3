"""Each service runs on the event loop its settings name: uvloop by default, the standard
library's on request, and the standard one (with a warning) where uvloop is missing."""

from __future__ import annotations

import asyncio
import logging
import sys

import pydantic
import pytest

from plexrl.service import loop_factory, run_until_signalled
from plexrl.settings import CommonSettings, GatewaySettings


def loop_module(event_loop: str) -> str:
    """The module of the loop a service set to `event_loop` runs on."""
    seen: list[str] = []

    async def serve(stop: asyncio.Event) -> None:
        seen.append(type(asyncio.get_running_loop()).__module__)
        assert not stop.is_set()

    run_until_signalled(serve, event_loop)
    return seen[0]


def test_services_run_on_uvloop_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    assert CommonSettings().event_loop == "uvloop"
    assert loop_module("uvloop").startswith("uvloop")
    assert loop_module("asyncio").startswith("asyncio")
    monkeypatch.setenv("PLEXRL_EVENT_LOOP", "asyncio")
    assert GatewaySettings().event_loop == "asyncio"
    monkeypatch.setenv("PLEXRL_EVENT_LOOP", "trio")
    with pytest.raises(pydantic.ValidationError, match="event_loop"):
        GatewaySettings()


def test_without_uvloop_the_standard_loop_runs_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    with caplog.at_level(logging.WARNING, logger="plexrl.service"):
        assert loop_factory("uvloop") is None
        assert loop_module("uvloop").startswith("asyncio")
    assert "uvloop is not installed" in caplog.text
