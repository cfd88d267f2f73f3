"""Model aliases: a served model answers to further names (say `Qwen/Qwen3-8B` for the tiny
Qwen3), so recipes that look model names up in their own tables run on it unchanged."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import tinker
from tinker import types
from transformers import AutoTokenizer
from typer.testing import CliRunner

from plexrl import hf_cache
from plexrl.models import PLEXRL_JSON, ModelRegistry, UnknownModelError, init_tiny
from plexrl_tools.cli import app
from plexrl_tools.cluster import ClusterConfig
from tests.conftest import SHARED_ALIASES

CANONICAL = "plexrl/tiny-qwen3"
ALIAS = "Qwen/Qwen3-8B"
OTHER_ALIAS = "Qwen/Qwen3-4B-Instruct-2507"


@pytest.fixture(scope="module")
def aliased(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A registry root holding one tiny Qwen3 that also answers to two hub names."""
    root = tmp_path_factory.mktemp("aliased-models")
    init_tiny(root / "tiny", aliases=[ALIAS, OTHER_ALIAS])
    return root


def test_an_alias_serves_the_same_model(aliased: Path) -> None:
    registry = ModelRegistry(aliased)
    assert registry.names() == sorted([CANONICAL, ALIAS, OTHER_ALIAS])
    assert registry.models() == [CANONICAL]
    by_alias, by_name = registry.info(ALIAS), registry.info(CANONICAL)
    assert by_alias == by_name  # one description: same path, canonical name, the aliases
    assert by_alias.name == CANONICAL and by_alias.aliases == (ALIAS, OTHER_ALIAS)
    assert registry.resolve(ALIAS) == registry.resolve(CANONICAL) == aliased / "tiny"
    meta = json.loads((aliased / "tiny" / PLEXRL_JSON).read_text())
    assert meta["aliases"] == [ALIAS, OTHER_ALIAS]
    with pytest.raises(UnknownModelError, match=ALIAS):  # the error lists aliases too
        registry.resolve("Qwen/Qwen3-32B")


def test_aliases_in_plexrl_json_are_checked(aliased: Path, tmp_path: Path) -> None:
    shutil.copytree(aliased / "tiny", tmp_path / "a")
    shutil.copytree(aliased / "tiny", tmp_path / "b")
    meta_b = tmp_path / "b" / PLEXRL_JSON
    # A second model claiming an alias the first one has: refused, naming both.
    meta_b.write_text(json.dumps({"name": "acme/other", "aliases": [ALIAS]}))
    with pytest.raises(ValueError, match="both named 'Qwen/Qwen3-8B'"):
        ModelRegistry(tmp_path).names()
    meta_b.write_text(json.dumps({"name": "acme/other", "aliases": "Qwen/Qwen3-8B"}))
    with pytest.raises(ValueError, match="aliases must be a list"):
        ModelRegistry(tmp_path).names()
    meta_b.write_text(json.dumps({"name": "acme/other", "aliases": ["acme/b"]}))
    assert ModelRegistry(tmp_path).names() == sorted(
        [CANONICAL, ALIAS, OTHER_ALIAS, "acme/other", "acme/b"]
    )


def test_every_alias_resolves_offline_in_the_hf_cache(aliased: Path, tmp_path: Path) -> None:
    cache = tmp_path / "hf"
    snapshots = hf_cache.register_all(aliased / "tiny", [CANONICAL, ALIAS, OTHER_ALIAS], cache)
    assert set(snapshots) == {CANONICAL, ALIAS, OTHER_ALIAS}
    local = AutoTokenizer.from_pretrained(aliased / "tiny")
    for name in snapshots:
        tok = AutoTokenizer.from_pretrained(name, cache_dir=str(cache))
        assert tok.get_vocab() == local.get_vocab()


def test_init_tiny_with_alias_on_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    models = tmp_path / "models"
    result = CliRunner().invoke(
        app,
        ["model", "init-tiny", str(models / "m"), "--warm-steps", "0", "--alias", ALIAS],
    )
    assert result.exit_code == 0, result.output
    assert f"also served as {ALIAS}" in result.output
    assert ModelRegistry(models).names() == sorted([CANONICAL, ALIAS])
    # What a recipe does with its configured model name, offline.
    tok = AutoTokenizer.from_pretrained(ALIAS, cache_dir=str(tmp_path / "hf"))
    assert tok.encode("12", add_special_tokens=False)
    listed = CliRunner().invoke(app, ["model", "list", "--registry", str(models)])
    assert listed.exit_code == 0 and f"aliases {ALIAS}" in listed.output


# The unmodified SDK against all four services, with an alias for a model name ---------

KEY = "tml-aliases"


@pytest.fixture(scope="module")
def service(shared_cluster: ClusterConfig) -> tinker.ServiceClient:
    """The session's shared cluster, which serves the tiny Qwen3 under these aliases too."""
    assert {ALIAS, OTHER_ALIAS} <= set(SHARED_ALIASES)
    return tinker.ServiceClient(base_url=shared_cluster.gateway_url, api_key=KEY)


@pytest.mark.integration
def test_a_training_client_created_with_an_alias_works_end_to_end(
    service: tinker.ServiceClient,
) -> None:
    capabilities = service.create_rest_client().get_server_capabilities().result()
    served = {m.model_name for m in capabilities.supported_models}
    assert {CANONICAL, ALIAS, OTHER_ALIAS} <= served

    client = service.create_lora_training_client(base_model=ALIAS, rank=4, seed=1).result()
    info = client.get_info()
    assert info.model_data.model_name == ALIAS
    # The tokenizer id resolves on this host with no hub, and is the served model's own.
    assert info.model_data.tokenizer_id is not None
    tok = AutoTokenizer.from_pretrained(info.model_data.tokenizer_id)
    assert client.get_tokenizer().get_vocab() == tok.get_vocab()

    tokens = tok.encode("12+7=19", add_special_tokens=False)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64")},
    )
    before = client.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = client.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    assert after < before

    sampler = client.save_weights_and_get_sampling_client().result()
    response = sampler.sample(
        types.ModelInput.from_ints(tokens[:3]),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=4, seed=1, temperature=1.0),
    ).result()
    assert len(response.sequences[0].tokens) >= 1

    # The canonical name and the alias name one model: the same weights, the same loss.
    twin = service.create_lora_training_client(base_model=CANONICAL, rank=4, seed=1).result()
    assert twin.forward([datum], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        before, rel=1e-5
    )
