"""The `plexrl` command line: model building and service entry points."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plexrl.models import ModelRegistry
from plexrl_tools.cli import app

runner = CliRunner()


def test_init_tiny_builds_a_served_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    result = runner.invoke(
        app,
        [
            "model",
            "init-tiny",
            str(tmp_path / "models" / "m"),
            "--warm-steps",
            "0",
            "--name",
            "acme/tiny",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "acme/tiny" in result.output
    assert ModelRegistry(tmp_path / "models").names() == ["acme/tiny"]
    assert (
        json.loads((tmp_path / "models" / "m" / "plexrl.json").read_text())["name"] == "acme/tiny"
    )
    # Resolvable offline by name, as the tinker SDK's SamplingClient.get_tokenizer() needs.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained("acme/tiny", cache_dir=str(tmp_path / "hf"))
    assert tok.encode("12", add_special_tokens=False)

    listed = runner.invoke(app, ["model", "list", "--registry", str(tmp_path / "models")])
    assert listed.exit_code == 0 and "acme/tiny" in listed.output


def test_init_tiny_takes_positions_and_think_tokens(tmp_path: Path) -> None:
    out = tmp_path / "models" / "m"
    args = ["model", "init-tiny", str(out), "--warm-steps", "0", "--no-hf-cache"]
    result = runner.invoke(app, [*args, "--max-positions", "2048", "--think-tokens"])
    assert result.exit_code == 0, result.output
    assert "2048 positions" in result.output
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(out).encode("</think>", add_special_tokens=False)) == 1
    refused = runner.invoke(app, [*args, "--max-positions", "4"])
    assert refused.exit_code != 0 and "at least 16" in refused.output


def test_bad_family_is_refused_with_the_choices(tmp_path: Path) -> None:
    result = runner.invoke(app, ["model", "init-tiny", str(tmp_path / "x"), "--family", "gpt"])
    assert result.exit_code != 0 and "qwen3" in result.output


def test_serve_names_the_four_services() -> None:
    result = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    for name in ("gateway", "scheduler", "gpu-worker", "state-store"):
        assert name in result.output
