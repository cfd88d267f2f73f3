"""Exported weights through the unmodified tinker SDK against a live cluster.

The four services as processes on the real Kafka and Redis, the tiny Qwen3, one LoRA
job: `save_weights_external` writes a PEFT adapter, `get_external_weights_urls` signs
a URL per file, and a plain HTTP client downloads them with no API key; the adapter
loads with plain transformers + peft and computes the job's own logprobs (within
1e-5, float32 on CPU). A tampered URL is refused (403), an expired one too (410);
files encrypted to an age recipient decrypt to the plain export's bytes; another
tenant's key gets no URLs; the job trains on afterwards.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import httpx
import pyrage
import pytest
import redis
import tinker
import torch
from peft import PeftModel
from tinker import types
from transformers import AutoModelForCausalLM

from plexrl.messages import decode
from plexrl.settings import GatewaySettings
from plexrl.stores import CheckpointRecord
from plexrl_gateway.signing import UrlSigner, signing_secret
from plexrl_tools.cluster import LocalCluster

pytestmark = pytest.mark.integration

KEY, OTHER_KEY = "tml-export", "tml-export-other"
BASE = "plexrl/tiny-qwen3"
URL_TTL_S = GatewaySettings.model_fields["export_url_ttl_s"].default
TOKENS = [3, 5, 7, 9, 11, 13, 17, 19]
ATOL = 1e-5


@pytest.fixture(scope="module")
def cluster(shared_services: LocalCluster) -> LocalCluster:
    return shared_services


@pytest.fixture(scope="module")
def service(cluster: LocalCluster) -> tinker.ServiceClient:
    os.environ["HF_HUB_OFFLINE"] = "1"
    return tinker.ServiceClient(base_url=cluster.config.gateway_url, api_key=KEY)


@pytest.fixture(scope="module")
def client(service: tinker.ServiceClient) -> tinker.TrainingClient:
    trainer = service.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    step(trainer)
    return trainer


@pytest.fixture(scope="module")
def export(client: tinker.TrainingClient) -> str:
    path = client.save_weights_external("final", ttl_seconds=7200).result(timeout=120).path
    assert path == f"tinker://{client.model_id}/external_weights/final"
    return path


@pytest.fixture(scope="module")
def first_urls(rest: tinker.RestClient, export: str) -> types.ExternalWeightsUrlsResponse:
    """The export's URLs signed once, early: downloaded at once by the first test."""
    return rest.get_external_weights_urls(export).result(timeout=60)


@pytest.fixture(scope="module")
def rest(cluster: LocalCluster) -> tinker.RestClient:
    return tinker.RestClient(base_url=cluster.config.gateway_url, api_key=KEY)


def datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=TOKENS[1:], dtype="int64"),
            "weights": types.TensorData(data=[1.0] * (len(TOKENS) - 1), dtype="float32"),
        },
    )


def step(trainer: tinker.TrainingClient) -> None:
    trainer.forward_backward([datum()], "cross_entropy").result(timeout=120)
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)


def download(urls: dict[str, str], into: Path) -> dict[str, bytes]:
    """Every file, with a plain HTTP client and no key; each checked against its ETag."""
    into.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, url in urls.items():
        response = httpx.get(url, timeout=60)
        assert response.status_code == 200, response.text
        assert int(response.headers["content-length"]) == len(response.content)
        assert response.headers["etag"] == f'"{hashlib.sha256(response.content).hexdigest()}"'
        (into / name).write_bytes(response.content)
        out[name] = response.content
    return out


def with_query(url: str, **changes: str) -> str:
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()} | changes
    return urlunsplit(parts._replace(query=urlencode(query)))


def test_an_export_downloads_as_a_peft_adapter_with_the_jobs_logprobs(
    rest: tinker.RestClient,
    client: tinker.TrainingClient,
    first_urls: types.ExternalWeightsUrlsResponse,
    tiny_registry: Path,
    tmp_path: Path,
) -> None:
    signed = first_urls
    assert set(signed.urls) == {"adapter_config.json", "adapter_model.safetensors"}
    assert 0 < signed.expires.timestamp() - time.time() <= URL_TTL_S + 1
    download(signed.urls, tmp_path / "adapter")

    out = client.forward([datum()], "cross_entropy").result(timeout=120)
    ours = torch.tensor(out.loss_fn_outputs[0]["logprobs"].data)
    base = AutoModelForCausalLM.from_pretrained(tiny_registry / "tiny-qwen3", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS[:-1]])).logits[0]
    theirs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
    torch.testing.assert_close(theirs, ours, rtol=0, atol=ATOL)

    listed = rest.list_checkpoints(client.model_id).result(timeout=60).checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type) for c in listed] == [
        ("external_weights/final", "external")
    ]


def test_the_ttl_sets_the_exports_expiry(
    cluster: LocalCluster, infra: dict[str, str], export: str
) -> None:
    meta = redis.Redis.from_url(infra["redis"])
    raw = meta.get(f"{cluster.config.cluster_id}:ckpt:{export}")
    meta.close()
    assert isinstance(raw, bytes)
    record: CheckpointRecord = decode(raw, CheckpointRecord)
    assert record.kind == "external_weights" and record.expires_at is not None
    assert 7000 < record.expires_at - time.time() <= 7200
    assert [f.name for f in record.files] == ["adapter_config.json", "adapter_model.safetensors"]


def test_a_tampered_url_is_refused(rest: tinker.RestClient, export: str) -> None:
    urls = rest.get_external_weights_urls(export).result(timeout=60).urls
    url = urls["adapter_model.safetensors"]
    expires = int(parse_qs(urlsplit(url).query)["expires"][0])
    for bad in (
        with_query(url, signature="0" * 64),
        with_query(url, expires=str(expires + 3600)),
        url.replace("adapter_model.safetensors?", "adapter_config.json?"),
    ):
        response = httpx.get(bad, timeout=30)
        assert response.status_code == 403, response.text
        assert "does not match" in response.json()["error"]
    assert httpx.get(url.split("?")[0], timeout=30).status_code == 422  # no signature at all


def test_encrypted_files_decrypt_to_the_plain_exports_bytes(
    rest: tinker.RestClient, client: tinker.TrainingClient, tmp_path: Path
) -> None:
    identity = pyrage.x25519.Identity.generate()
    sealed = client.save_weights_external(
        "sealed", age_encryption_recipients=[str(identity.to_public())]
    )
    plain = client.save_weights_external("plain")  # the same weights: nothing trains between
    sealed_path, plain_path = sealed.result(timeout=120).path, plain.result(timeout=120).path
    sealed_files = download(rest.get_external_weights_urls(sealed_path).result().urls, tmp_path)
    plain_files = download(rest.get_external_weights_urls(plain_path).result().urls, tmp_path)
    assert set(sealed_files) == {name + ".age" for name in plain_files}
    for name, data in plain_files.items():
        assert pyrage.decrypt(sealed_files[name + ".age"], [identity]) == data

    # A resumed download: the file's tail only.
    plain_urls = rest.get_external_weights_urls(plain_path).result().urls
    weights = plain_files["adapter_model.safetensors"]
    tail = httpx.get(
        plain_urls["adapter_model.safetensors"], headers={"range": "bytes=100-"}, timeout=30
    )
    assert tail.status_code == 206 and tail.content == weights[100:]
    assert tail.headers["content-range"] == f"bytes 100-{len(weights) - 1}/{len(weights)}"
    # Deleted, its URLs are gone too.
    rest.delete_checkpoint_from_tinker_path(plain_path).result(timeout=60)
    gone = httpx.get(plain_urls["adapter_config.json"], timeout=30)
    assert gone.status_code == 404 and "deleted" in gone.json()["error"]

    with pytest.raises(tinker.BadRequestError, match="not a valid key"):
        client.save_weights_external("bad", age_encryption_recipients=["age1nope"]).result()


def test_another_tenants_key_gets_no_urls(cluster: LocalCluster, export: str) -> None:
    other = tinker.RestClient(base_url=cluster.config.gateway_url, api_key=OTHER_KEY)
    with pytest.raises(tinker.NotFoundError):
        other.get_external_weights_urls(export).result(timeout=60)


def test_the_job_trains_and_saves_on_after_exporting(client: tinker.TrainingClient) -> None:
    step(client)
    assert client.save_state("after").result(timeout=120).path.endswith("/weights/after")
    sampler_path = client.save_weights_for_sampler("s").result(timeout=120).path
    with pytest.raises(tinker.BadRequestError, match="not loaded or sampled"):
        client.load_state(
            sampler_path.replace("sampler_weights/s", "external_weights/final")
        ).result(timeout=60)


def test_an_expired_url_is_refused(
    cluster: LocalCluster, first_urls: types.ExternalWeightsUrlsResponse, export: str
) -> None:
    """A URL signed under the cluster's own secret, whose expiry has passed: the gateway
    must refuse it for its age alone (a wrong signature is a 403, tested above)."""
    url = first_urls.urls["adapter_config.json"]
    expires = int(time.time()) - 2
    signer = UrlSigner(signing_secret(None, cluster.service_token))
    signature = signer.sign(export, "adapter_config.json", expires)
    response = httpx.get(with_query(url, expires=str(expires), signature=signature), timeout=30)
    assert response.status_code == 410, response.text
    assert "expired" in response.json()["error"]
