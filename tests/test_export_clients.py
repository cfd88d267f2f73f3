"""Exported weights read by clients nobody here wrote, against a live cluster.

The four services as processes on the real Kafka and Redis, the tiny Qwen3, one LoRA job
trained a few steps, then exported (`save_weights_external`) and saved (`save_state`).
What reads them is unmodified third-party code:

- the SDK's own CLI, `tinker checkpoint download`, of the export and of the training
  checkpoint (which it exports through a temporary training run of its own, then
  deletes);
- tinker-cookbook's `weights.download` (of both; the training checkpoint through an
  age-encrypted temporary export), `build_lora_adapter` and `build_hf_model` over the
  tiny model's directory;
- plain transformers + peft, whose logprobs must be PlexRL's own (`compute_logprobs` and
  `forward`) on the same tokens;
- SGLang, loading the adapter through its `/load_lora_adapter` API and sampling from it.

The cookbook is scripts/sdk_matrix.sh's side install and SGLang scripts/sglang.sh's
venv; without them their tests skip (under CI=true they fail).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import tinker
import torch
from peft import PeftModel
from safetensors.torch import load_file
from tinker import types
from transformers import AutoModelForCausalLM

from plexrl_tools.cluster import LocalCluster
from tests.sdk_support import COOKBOOK, side_install, tinker_cli

if TYPE_CHECKING:
    from plexrl_worker.sglang import SGLangSampler

pytestmark = pytest.mark.integration

KEY = "tml-export-clients"
BASE = "plexrl/tiny-qwen3"
RANK = 4
# A prompt of ids the tiny tokenizer has; scored whole by every reader below.
TOKENS = [3, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37]
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors"}

# Tolerances on one logprob, float32 on CPU throughout (measured on this machine: 0.0
# for the first, 4.8e-7 for the sampler and the merged model):
FORWARD_ATOL = 1e-5
"""peft over the base against the training client's `forward`: the same modules in the
same order (PlexRL's engine is transformers + peft too)."""
SAMPLER_ATOL = 1e-5
"""against the sampler's `compute_logprobs`, which runs the adapter through the
sampler's own path (its KV cache and batching), not the trainer's."""
MERGED_ATOL = 1e-5
"""a model with the adapter merged into its weights (`build_hf_model`): W + s·BA
rounds differently from Wx + s·B(Ax)."""
SGLANG_ATOL = 1e-2
"""SGLang's torch-native kernels against transformers (measured 6.1e-4 here, up to 1.3e-3
in tests/test_sglang.py); without the adapter a logprob moves by 2.7 (checked)."""


@dataclass(frozen=True)
class Trained:
    """The job, its export and checkpoint, and what PlexRL says of TOKENS after training."""

    rest: tinker.RestClient
    export: str
    """tinker://<run>/external_weights/final"""
    checkpoint: str
    """tinker://<run>/weights/final"""
    forward: list[float]
    """The trainer's `forward` logprobs of TOKENS[1:]."""
    sampler: list[float]
    """The sampler's `compute_logprobs` of TOKENS[1:]."""


@pytest.fixture(scope="module")
def cluster(shared_services: LocalCluster) -> LocalCluster:
    return shared_services


def _datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=TOKENS[1:], dtype="int64"),
            "weights": types.TensorData(data=[1.0] * (len(TOKENS) - 1), dtype="float32"),
        },
    )


@pytest.fixture(scope="module")
def trained(cluster: LocalCluster) -> Trained:
    os.environ["HF_HUB_OFFLINE"] = "1"
    url = cluster.config.gateway_url
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    trainer = service.create_lora_training_client(base_model=BASE, rank=RANK, seed=3).result()
    # A few steps at a high rate: the adapter moves the logprobs well past every
    # tolerance here, so a reader that dropped it would fail.
    for _ in range(3):
        trainer.forward_backward([_datum()], "cross_entropy").result(timeout=120)
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=120)
    export = trainer.save_weights_external("final").result(timeout=120).path
    checkpoint = trainer.save_state("final").result(timeout=120).path
    out = trainer.forward([_datum()], "cross_entropy").result(timeout=120)
    forward = [float(v) for v in out.loss_fn_outputs[0]["logprobs"].data]
    sampling = trainer.save_weights_and_get_sampling_client().result(timeout=120)
    scored = sampling.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result(timeout=120)
    assert scored[0] is None
    sampler = [float(v) for v in scored[1:] if v is not None]
    return Trained(
        tinker.RestClient(base_url=url, api_key=KEY), export, checkpoint, forward, sampler
    )


def _logprobs(model: torch.nn.Module) -> list[float]:
    """What a Hugging Face causal LM gives TOKENS[1:] after their prefixes (T=1)."""
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS[:-1]])).logits[0]
    picked = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(TOKENS[1:])[:, None])
    return [float(v) for v in picked[:, 0]]


def _base(tiny_registry: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_registry / "tiny-qwen3", dtype=torch.float32)


def _peft(tiny_registry: Path, adapter: Path) -> list[float]:
    return _logprobs(PeftModel.from_pretrained(_base(tiny_registry), adapter).eval())


def _close(ours: list[float], theirs: list[float], atol: float) -> None:
    torch.testing.assert_close(torch.tensor(theirs), torch.tensor(ours), rtol=0, atol=atol)


def _tensors(adapter: Path) -> dict[str, torch.Tensor]:
    return load_file(adapter / "adapter_model.safetensors")


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


# The SDK's CLI ---------------------------------------------------------------------------


def _tinker_cli(cluster: LocalCluster, *args: str) -> dict[str, Any]:
    """`tinker --format json ARGS` as a user runs it; its JSON answer."""
    done = tinker_cli(cluster.config.gateway_url, KEY, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


@pytest.fixture(scope="module")
def cli_export(
    cluster: LocalCluster, trained: Trained, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    out = tmp_path_factory.mktemp("cli-export")
    answer = _tinker_cli(cluster, "checkpoint", "download", trained.export, "--output", str(out))
    return Path(answer["destination"])


def test_the_tinker_cli_downloads_the_export_byte_for_byte(
    trained: Trained, cli_export: Path, tiny_registry: Path
) -> None:
    assert cli_export.name == trained.export.removeprefix("tinker://").replace("/", "_")
    assert {p.name for p in cli_export.iterdir()} == ADAPTER_FILES
    signed = trained.rest.get_external_weights_urls(trained.export).result(timeout=60)
    for name, url in signed.urls.items():
        assert (cli_export / name).read_bytes() == httpx.get(url, timeout=60).content, name
    config = json.loads((cli_export / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["base_model_name_or_path"]) == (
        "LORA",
        RANK,
        BASE,
    )


def test_the_tinker_cli_exports_a_training_checkpoint_through_a_run_of_its_own(
    cluster: LocalCluster, trained: Trained, cli_export: Path, tmp_path: Path
) -> None:
    # It loads the checkpoint into a new training run, exports that as "download" for
    # an hour, downloads it and deletes the export.
    answer = _tinker_cli(
        cluster, "checkpoint", "download", trained.checkpoint, "--output", str(tmp_path)
    )
    got = Path(answer["destination"])
    assert {p.name for p in got.iterdir()} == ADAPTER_FILES
    _same_tensors(_tensors(got), _tensors(cli_export))
    left = trained.rest.list_user_checkpoints().result(timeout=60).checkpoints
    assert [c.tinker_path for c in left if c.checkpoint_id == "external_weights/download"] == []


def test_peft_over_the_base_gives_plexrls_logprobs(
    trained: Trained, cli_export: Path, tiny_registry: Path
) -> None:
    theirs = _peft(tiny_registry, cli_export)
    _close(trained.forward, theirs, FORWARD_ATOL)
    _close(trained.sampler, theirs, SAMPLER_ATOL)
    # The adapter matters: the base alone is far from both.
    base = _logprobs(_base(tiny_registry).eval())
    assert max(abs(a - b) for a, b in zip(base, theirs, strict=True)) > 0.1


# tinker-cookbook's weights ----------------------------------------------------------------

# Run with the cookbook first on the path: download both paths, then build a PEFT
# adapter and a merged model over the tiny model's directory (float32, as trained).
_COOKBOOK_WEIGHTS = """
import json, sys
from tinker_cookbook import weights

url, export, checkpoint, base_dir, out = sys.argv[1:]
weights.download(tinker_path=export, output_dir=out + "/export", base_url=url)
weights.download(tinker_path=checkpoint, output_dir=out + "/checkpoint", base_url=url)
weights.build_lora_adapter(
    base_model=base_dir, adapter_path=out + "/export", output_path=out + "/peft"
)
weights.build_hf_model(
    base_model=base_dir, adapter_path=out + "/export", output_path=out + "/merged",
    dtype="float32",
)
print(json.dumps("done"))
"""


@pytest.fixture(scope="module")
def cookbook_built(
    cluster: LocalCluster,
    trained: Trained,
    tiny_registry: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    cookbook = side_install(COOKBOOK)
    out = tmp_path_factory.mktemp("cookbook-weights")
    env = {
        **os.environ,
        "PYTHONPATH": str(cookbook),
        "TINKER_API_KEY": KEY,
        "HF_HUB_OFFLINE": "1",
    }
    args = [cluster.config.gateway_url, trained.export, trained.checkpoint]
    cmd = [sys.executable, "-c", _COOKBOOK_WEIGHTS, *args, str(tiny_registry / "tiny-qwen3")]
    done = subprocess.run(
        [*cmd, str(out)], env=env, capture_output=True, text=True, timeout=600, cwd=out
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-8000:]
    return out


def test_the_cookbook_downloads_both_paths_to_the_same_adapter(
    cookbook_built: Path, cli_export: Path
) -> None:
    for got in (cookbook_built / "export", cookbook_built / "checkpoint"):
        assert {p.name for p in got.iterdir()} == ADAPTER_FILES, got
        _same_tensors(_tensors(got), _tensors(cli_export))


def test_the_cookbooks_peft_adapter_and_merged_model_give_plexrls_logprobs(
    trained: Trained, cookbook_built: Path, tiny_registry: Path
) -> None:
    _close(trained.forward, _peft(tiny_registry, cookbook_built / "peft"), FORWARD_ATOL)
    merged = AutoModelForCausalLM.from_pretrained(
        cookbook_built / "merged", dtype=torch.float32
    ).eval()
    _close(trained.forward, _logprobs(merged), MERGED_ATOL)


# SGLang ----------------------------------------------------------------------------------


def test_sglang_loads_the_adapter_and_samples_from_it(
    sglang_sampler: SGLangSampler,
    trained: Trained,
    cookbook_built: Path,
    tiny_registry: Path,
) -> None:
    # The session's SGLang server over the same tiny model (tests/conftest.py), started
    # with --enable-lora; the adapter goes in through its own HTTP API.
    url = sglang_sampler.server.url
    with httpx.Client(base_url=url, timeout=300) as http:
        loaded = http.post(
            "/load_lora_adapter",
            json={"lora_name": "export-clients", "lora_path": str(cookbook_built / "peft")},
        )
        assert loaded.status_code == 200, loaded.text

        def generate(lora: str | None) -> dict[str, Any]:
            body: dict[str, Any] = {
                "input_ids": TOKENS,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
                "return_logprob": True,
                "logprob_start_len": 0,
            }
            if lora is not None:
                body["lora_path"] = lora
            answer = http.post("/generate", json=body)
            assert answer.status_code == 200, answer.text
            out: dict[str, Any] = answer.json()
            return out

        try:
            tuned, base = generate("export-clients"), generate(None)
        finally:
            http.post("/unload_lora_adapter", json={"lora_name": "export-clients"})

    assert len(tuned["output_ids"]) == 4
    scored = [float(lp) for lp, *_ in tuned["meta_info"]["input_token_logprobs"][1:]]
    _close(trained.forward, scored, SGLANG_ATOL)
    untuned = [float(lp) for lp, *_ in base["meta_info"]["input_token_logprobs"][1:]]
    assert max(abs(a - b) for a, b in zip(untuned, scored, strict=True)) > 10 * SGLANG_ATOL
