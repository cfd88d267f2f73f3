"""docker-compose.yml, read without Docker: the file parses, every PLEXRL_* name is a
setting its service reads, every image is pinned, every service has a health check,
Redis persists, and Prometheus scrapes every PlexRL service."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings

from plexrl.settings import (
    CommonSettings,
    GatewaySettings,
    SchedulerSettings,
    StateStoreSettings,
    WorkerSettings,
)

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]

# `plexrl serve <what>` → the settings class that process reads.
SETTINGS: dict[str, type[BaseSettings]] = {
    "gateway": GatewaySettings,
    "scheduler": SchedulerSettings,
    "gpu-worker": WorkerSettings,
    "state-store": StateStoreSettings,
}


def env_names(settings: type[BaseSettings]) -> set[str]:
    prefix = str(settings.model_config.get("env_prefix", ""))
    return {(prefix + name).upper() for name in settings.model_fields}


def settings_of(service: dict[str, Any]) -> type[BaseSettings] | None:
    command = service.get("command") or []
    if isinstance(command, list) and command[:2] == ["plexrl", "serve"]:
        return SETTINGS[command[2]]
    return None


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the `- NAME=value` form
        env = dict(entry.split("=", 1) for entry in env)
    return {str(k): str(v) for k, v in env.items()}


def test_every_plexrl_env_name_is_a_setting_of_its_service() -> None:
    every = set().union(*(env_names(s) for s in SETTINGS.values()))
    for name, service in SERVICES.items():
        reads = settings_of(service)
        allowed = env_names(reads) if reads is not None else every
        unknown = {k for k in environment(service) if k.startswith("PLEXRL_")} - allowed
        assert not unknown, f"{name} sets {unknown}, which {reads or 'no service'} reads"


def test_the_four_services_are_all_there_with_host_ports() -> None:
    served = {settings_of(s) for s in SERVICES.values()} - {None}
    assert served == set(SETTINGS.values())
    for name, service in SERVICES.items():
        reads = settings_of(service)
        if reads is None:
            continue
        env = environment(service)
        port = next(v for k, v in env.items() if k.endswith("_PORT"))
        # API and /metrics are one port per service; it must be reachable from the host.
        published = [str(p).rsplit(":", 2)[-2:] for p in service.get("ports", [])]
        assert [port, port] in published, f"{name} does not publish its port {port}"
        assert env[next(k for k in env if k.endswith("_HOST"))] == "0.0.0.0", name


def test_services_share_one_service_token() -> None:
    tokens = {
        environment(s).get("PLEXRL_SERVICE_TOKEN")
        for s in SERVICES.values()
        if settings_of(s) is not None
    }
    assert len(tokens) == 1 and None not in tokens, tokens
    assert "service_token" in CommonSettings.model_fields


def test_every_image_tag_is_pinned() -> None:
    for name, service in SERVICES.items():
        image = service["image"]
        if "build" in service:
            continue  # built here from the lock
        repository, _, tag = image.rpartition(":")
        assert repository and tag, f"{name}: image {image!r} has no tag"
        assert tag != "latest", f"{name}: {image!r} floats"
        # A full version (major.minor.patch), never a moving major or minor tag.
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{name}: {image!r} is not pinned"
    assert SERVICES["jaeger"]["image"].startswith("jaegertracing/jaeger:2.")


def test_every_service_has_a_healthcheck_and_waits_on_healthy_dependencies() -> None:
    for name, service in SERVICES.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for dependency, condition in (service.get("depends_on") or {}).items():
            assert condition["condition"] in (
                "service_healthy",
                "service_completed_successfully",
            ), (name, dependency)


def test_redis_persists_to_an_append_only_file_on_a_volume() -> None:
    redis = SERVICES["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--appendfsync everysec" in command
    assert any(v.split(":")[1] == "/data" for v in redis["volumes"])
    assert "--dir /data" in command


def test_model_init_skips_a_model_that_is_there() -> None:
    script = " ".join(SERVICES["model-init"]["command"])
    assert "if [ -f /models/.tiny-qwen.done ]" in script
    # The marker is the last thing written, so a build cut short is redone.
    assert script.endswith("&& touch /models/.tiny-qwen.done; fi")


def test_tokenizer_names_are_resolvable_where_the_gateway_looks() -> None:
    # model-init registers the tokenizer in the HF cache the gateway reads.
    assert (
        environment(SERVICES["model-init"])["HF_HOME"]
        == environment(SERVICES["gateway"])["HF_HOME"]
    )
    mounts = {v.split(":")[1] for v in SERVICES["gateway"]["volumes"]}
    assert environment(SERVICES["gateway"])["HF_HOME"].startswith(tuple(mounts))


def test_prometheus_scrapes_every_plexrl_service() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {
        target
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    for name, service in SERVICES.items():
        if settings_of(service) is None:
            continue
        port = next(v for k, v in environment(service).items() if k.endswith("_PORT"))
        assert f"{name}:{port}" in targets, f"Prometheus does not scrape {name}"
    mounted = " ".join(SERVICES["prometheus"]["volumes"])
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml" in mounted


@pytest.mark.parametrize(
    "path", sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json")), ids=str
)
def test_grafana_dashboards_are_json_over_plexrl_metrics(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs and all("plexrl_" in e for e in exprs)


def test_plexrl_model_cache_makes_a_copied_registry_resolvable_on_the_host(
    tiny_registry: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the compose header tells a host user to run after `docker compose cp`."""
    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    from plexrl import hf_cache
    from plexrl_tools.cli import app

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert not hf_cache.is_registered("plexrl/tiny-qwen3")
    result = CliRunner().invoke(app, ["model", "cache", str(tiny_registry)])
    assert result.exit_code == 0, result.output
    # The gateway now names the tokenizer by the model's name, and the SDK finds it.
    assert hf_cache.is_registered("plexrl/tiny-qwen3")
    tokenizer = AutoTokenizer.from_pretrained(
        "plexrl/tiny-qwen3", cache_dir=tmp_path / "hub", local_files_only=True
    )
    assert tokenizer.encode("12", add_special_tokens=False)
