"""Kafka, Redis and the services' own HTTP over TLS, for clusters whose hosts share a
network they do not trust (docs/deploy.md, the trust boundary).

A real broker (scripts/infra.sh) with two TLS listeners beside its PLAINTEXT one: SSL
that requires a client certificate, and SASL_SSL (PLAIN: a user and a password over
TLS); a real Redis that serves only TLS and requires a client certificate. The
certificates come from a throwaway CA (`plexrl_tools.tls`). Each listener refuses a
client without what it requires; then all four services run on the SASL_SSL listener
and the TLS Redis, serving HTTPS to each other and to the tinker SDK, through which a
job trains, saves and samples.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
import tinker
from aiokafka.errors import KafkaError
from tinker import types

from plexrl.kafka import ensure_topics, wait_for_kafka
from plexrl.kafka_security import KafkaSecurity
from plexrl.settings import CommonSettings
from plexrl_tools.cluster import ClusterConfig, ClusterTls, LocalCluster, free_ports
from plexrl_tools.private_infra import PrivateInfra
from plexrl_tools.tls import Pki, make_pki

pytestmark = pytest.mark.integration

KEY = "tml-tls"
USER, PASSWORD = "plexrl", "over-tls-only"


@dataclass(frozen=True)
class Brokers:
    pki: Pki
    ssl: str
    """Bootstrap of the SSL listener (client certificate required)."""
    sasl_ssl: str
    """Bootstrap of the SASL_SSL listener (PLAIN)."""


def test_security_settings_that_cannot_work_are_refused_saying_what_to_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not read until a client starts")
    with pytest.raises(ValueError, match="PLEXRL_KAFKA_SSL_CERTFILE and PLEXRL_KAFKA_SSL_KEYFILE"):
        KafkaSecurity("SSL", str(ca), certfile=str(ca))
    with pytest.raises(ValueError, match="set it to SSL or SASL_SSL"):
        KafkaSecurity("PLAINTEXT", str(ca))
    with pytest.raises(ValueError, match=r"PLEXRL_KAFKA_SSL_CAFILE .* is not a file"):
        KafkaSecurity("SSL", str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="needs PLEXRL_KAFKA_SASL_MECHANISM"):
        KafkaSecurity("SASL_SSL", str(ca), sasl_mechanism="PLAIN", sasl_username="u")
    with pytest.raises(ValueError, match="set it to SASL_SSL"):
        KafkaSecurity("SSL", sasl_mechanism="PLAIN", sasl_username="u", sasl_password="p")
    # The services' settings build it, and refuse the same at start.
    monkeypatch.setenv("PLEXRL_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("PLEXRL_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("PLEXRL_KAFKA_SASL_USERNAME", "plexrl")
    with pytest.raises(ValueError, match="PLEXRL_KAFKA_SASL_PASSWORD"):
        CommonSettings()
    monkeypatch.setenv("PLEXRL_KAFKA_SASL_PASSWORD", "secret")
    options = CommonSettings().kafka_security().client_options()
    assert options["security_protocol"] == "SASL_SSL"
    assert options["sasl_mechanism"] == "SCRAM-SHA-512"
    assert options["ssl_context"].verify_mode == ssl.CERT_REQUIRED
    assert CommonSettings.model_fields["kafka_security_protocol"].default == "PLAINTEXT"
    with pytest.raises(ValueError, match="PLEXRL_HTTP_TLS_CERTFILE and PLEXRL_HTTP_TLS_KEYFILE"):
        CommonSettings(http_tls_certfile=str(ca))
    with pytest.raises(ValueError, match=r"PLEXRL_HTTP_TLS_KEYFILE .* is not a file"):
        CommonSettings(http_tls_certfile=str(ca), http_tls_keyfile=str(tmp_path / "no.key"))
    assert CommonSettings().http_scheme == "http"
    both = CommonSettings(http_tls_certfile=str(ca), http_tls_keyfile=str(ca))
    assert both.http_scheme == "https"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def brokers(pki: Pki) -> Iterator[Brokers]:
    infra = PrivateInfra(parts=("broker",))
    taken = {infra.kafka_port, infra.kafka_port + 1}
    ssl_port, sasl_port = [p for p in free_ports(4) if p not in taken][:2]
    infra.settings.update(
        PLEXRL_KAFKA_TLS_DIR=str(pki.ca.parent),
        PLEXRL_KAFKA_SSL_PORT=str(ssl_port),
        PLEXRL_KAFKA_SASL_SSL_PORT=str(sasl_port),
        PLEXRL_KAFKA_SASL_USERS=f"{USER}:{PASSWORD}",
    )
    infra.up()
    try:
        yield Brokers(pki, f"127.0.0.1:{ssl_port}", f"127.0.0.1:{sasl_port}")
    finally:
        infra.down()
        infra.remove()


@pytest.fixture(scope="module")
def tls_redis(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis that speaks only TLS and admits only clients with a certificate the CA
    signed; its URL, with the client's files as redis-py's query parameters."""
    (port,) = free_ports(1)
    data = tmp_path_factory.mktemp("tls-redis")
    server = subprocess.Popen(
        [
            "redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key),
            "--tls-ca-cert-file", str(pki.ca), "--tls-auth-clients", "yes",
            "--save", "", "--appendonly", "no", "--dir", str(data),
        ],
        stdout=(data / "redis.log").open("ab"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = (
        f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={pki.ca}"
        f"&ssl_certfile={pki.client_cert}&ssl_keyfile={pki.client_key}"
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_each_tls_listener_admits_only_clients_with_what_it_requires(brokers: Brokers) -> None:
    pki = brokers.pki
    with_cert = KafkaSecurity("SSL", str(pki.ca), str(pki.client_cert), str(pki.client_key))
    with_user = KafkaSecurity(
        "SASL_SSL", str(pki.ca), sasl_mechanism="PLAIN", sasl_username=USER,
        sasl_password=PASSWORD,
    )  # fmt: skip
    wrong_password = KafkaSecurity(
        "SASL_SSL", str(pki.ca), sasl_mechanism="PLAIN", sasl_username=USER, sasl_password="no"
    )
    refused = [
        (brokers.ssl, KafkaSecurity("SSL", str(pki.ca))),  # no client certificate
        (brokers.ssl, KafkaSecurity()),  # PLAINTEXT to a TLS port
        (brokers.sasl_ssl, KafkaSecurity("SSL", str(pki.ca))),  # TLS, but no user
        (brokers.sasl_ssl, wrong_password),
        (brokers.ssl, KafkaSecurity("SSL")),  # the system's CAs never signed the broker
    ]

    async def run() -> None:
        topic = f"tls-{uuid.uuid4().hex[:8]}"
        for bootstrap, security in ((brokers.ssl, with_cert), (brokers.sasl_ssl, with_user)):
            await wait_for_kafka(bootstrap, 30, security)
            await ensure_topics(bootstrap, {topic: 1}, security=security)
        for bootstrap, security in refused:
            with pytest.raises((RuntimeError, KafkaError, ssl.SSLError, OSError)):
                await asyncio.wait_for(wait_for_kafka(bootstrap, 2, security), 20)

    asyncio.run(run())


def test_a_redis_client_without_a_certificate_is_refused(tls_redis: str) -> None:
    without = tls_redis.split("&ssl_certfile", 1)[0]
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(without, socket_connect_timeout=5).ping()


def test_every_service_runs_over_tls_to_kafka_redis_and_each_other(
    brokers: Brokers,
    tls_redis: str,
    tiny_registry: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pki = brokers.pki
    context = ssl.create_default_context(cafile=str(pki.ca))
    config = ClusterConfig.on_free_ports(
        tiny_registry,
        tmp_path_factory.mktemp("tls-cluster"),
        "tls",
        api_keys=f"{KEY}=tls",
        worker_threads=1,
        env={
            "PLEXRL_KAFKA_BOOTSTRAP": brokers.sasl_ssl,
            "PLEXRL_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "PLEXRL_KAFKA_SSL_CAFILE": str(pki.ca),
            "PLEXRL_KAFKA_SASL_MECHANISM": "PLAIN",
            "PLEXRL_KAFKA_SASL_USERNAME": USER,
            "PLEXRL_KAFKA_SASL_PASSWORD": PASSWORD,
            "PLEXRL_REDIS_URL": tls_redis,
        },
        tls=ClusterTls(pki.server_cert, pki.server_key, pki.ca),
    )
    with LocalCluster(config) as cluster:
        os.environ["HF_HUB_OFFLINE"] = "1"
        # HTTPS only, on every service's port (the API, /healthz, /metrics alike).
        for port in (config.gateway_port, config.scheduler_port, config.state_store_port):
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
            assert httpx.get(f"https://127.0.0.1:{port}/healthz", verify=context).status_code == 200
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                httpx.get(f"https://127.0.0.1:{port}/healthz", timeout=5)  # not our CA
        # The tinker SDK trusts the cluster's CA as any httpx client does.
        monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca))
        service = tinker.ServiceClient(base_url=cluster.config.gateway_url, api_key=KEY)
        trainer = service.create_lora_training_client(
            base_model="plexrl/tiny-qwen3", rank=4, seed=0
        ).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={
                "target_tokens": types.TensorData(data=[6, 7, 8, 9], dtype="int64"),
                "weights": types.TensorData(data=[1.0] * 4, dtype="float32"),
            },
        )
        loss = trainer.forward_backward([datum], "cross_entropy").result()
        assert loss.metrics
        trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        saved = trainer.save_state("over-tls").result()
        assert saved.path.startswith("tinker://")
        sampler = trainer.save_weights_and_get_sampling_client().result()
        sample = sampler.sample(
            types.ModelInput.from_ints([5, 6, 7]),
            num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=3, temperature=0.0),
        ).result()
        assert len(sample.sequences[0].tokens) == 3
