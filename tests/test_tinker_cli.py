"""The SDK's own CLI (`tinker`) against the shared cluster: logging in with a PlexRL
key, and the commands PlexRL answers with what to use instead. Its checkpoint and
session commands are tested beside what they read (tests/test_export_clients.py,
tests/test_session_trace.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plexrl_tools.cluster import LocalCluster
from tests.sdk_support import tinker_cli

KEY = "tml-cli"
TENANT = "cli-user"


@pytest.fixture(scope="module")
def url(shared_services: LocalCluster) -> str:
    return shared_services.config.gateway_url


def test_auth_login_takes_a_plexrl_key_and_the_cli_then_runs_on_it(
    url: str, tmp_path: Path
) -> None:
    login = tinker_cli(url, None, "auth", "login", home=tmp_path, stdin=KEY + "\n")
    assert login.returncode == 0, login.stdout + login.stderr
    assert f"({TENANT})" in login.stdout
    stored = json.loads((tmp_path / ".tinker" / "credentials.json").read_text())
    assert KEY in json.dumps(stored)
    runs = tinker_cli(url, None, "run", "list", home=tmp_path)  # no key in the environment
    assert runs.returncode == 0, runs.stdout + runs.stderr
    assert json.loads(runs.stdout) == {"runs": []}  # its tenant's, none yet
    logout = tinker_cli(url, None, "auth", "logout", home=tmp_path)
    assert logout.returncode == 0, logout.stdout + logout.stderr
    assert KEY not in (tmp_path / ".tinker" / "credentials.json").read_text()


def test_auth_login_refuses_a_key_the_gateway_does_not_know(url: str, tmp_path: Path) -> None:
    login = tinker_cli(url, None, "auth", "login", home=tmp_path, stdin="tml-nobody\n")
    assert login.returncode != 0
    assert "Could not validate the API key" in login.stdout + login.stderr


def test_billing_usage_says_what_plexrl_measures_instead(url: str) -> None:
    done = tinker_cli(url, KEY, "billing", "usage", "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z")
    answer = done.stdout + done.stderr
    assert done.returncode != 0
    assert "device time" in answer and "/plexrl/v1/jobs" in answer
