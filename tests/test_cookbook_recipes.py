"""tinker-cookbook's recipes, unchanged, against all four services.

`sl_loop`, `rl_loop` (its default loss, stable_reinforce) and `math_rl.train` (its default
arithmetic environment and loss) run as `python -m tinker_cookbook.recipes...` with only
their config set: base URL, a model name the cookbook knows (served as an alias of the
tiny Qwen3), tiny batches, two or three steps. The hub data sets they load are written
locally in the hub's cached format (tests/cookbook_data.py), and the tokenizer resolves
offline from a Hugging Face cache the test fills. The cookbook is the side install of
scripts/sdk_matrix.sh (docs/sdk.md), run with .venv's Python and its tinker 0.38.0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from plexrl import hf_cache
from plexrl.cluster import ClusterConfig, LocalCluster
from plexrl.models import init_tiny
from tests import cookbook_data
from tests.conftest import ROOT, free_port
from tests.test_sdk_versions import side_install

pytestmark = pytest.mark.integration

COOKBOOK = "tinker-cookbook-0.6.1"
# A name in the cookbook's model table (renderer qwen3), served by the tiny Qwen3.
MODEL = "Qwen/Qwen3-8B"
KEY = "tml-cookbook"


@dataclass
class Recipes:
    cookbook: Path
    env: dict[str, str]
    base_url: str
    runs: Path

    def run(self, module: str, name: str, *args: str) -> list[dict[str, Any]]:
        """Run recipe `module` with `args` (chz `key=value`); its metrics.jsonl rows."""
        log_path = self.runs / name
        cmd = [
            sys.executable,
            "-m",
            f"tinker_cookbook.recipes.{module}",
            f"base_url={self.base_url}",
            f"model_name={MODEL}",
            "lora_rank=4",
            "save_every=0",
            f"log_path={log_path}",
            *args,
        ]
        done = subprocess.run(
            cmd, env=self.env, cwd=self.runs, capture_output=True, text=True, timeout=900
        )
        output = (done.stdout + done.stderr)[-8000:]
        assert done.returncode == 0, f"{module} failed ({done.returncode}):\n{output}"
        metrics = log_path / "metrics.jsonl"
        assert metrics.is_file(), f"{module} wrote no {metrics}:\n{output}"
        return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def recipes(infra: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recipes]:
    cookbook = side_install(COOKBOOK)
    work = tmp_path_factory.mktemp("cookbook")
    registry, hf, data, runs = work / "models", work / "hf", work / "datasets", work / "runs"
    runs.mkdir()
    model_dir = init_tiny(registry / "tiny", aliases=[MODEL])
    questions = [row["question"] for row in cookbook_data.gsm8k(32)]
    examples = cookbook_data.rl_loop_examples(questions, answers=("1", "2"))
    examples += cookbook_data.arithmetic_examples(32)
    cookbook_data.warm(model_dir, examples, steps=80)
    hf_cache.register_all(model_dir, [MODEL], hf)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(cookbook), str(ROOT)]),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_CACHE": str(hf),
        "HF_DATASETS_CACHE": str(data),
        "TINKER_API_KEY": KEY,
    }
    env.pop("TINKER_BASE_URL", None)
    # The data sets, written with the cookbook's own `datasets` (not in .venv).
    subprocess.run(
        [sys.executable, "-m", "tests.cookbook_data", str(data)],
        env=env,
        check=True,
        cwd=ROOT,
        timeout=300,
    )

    config = ClusterConfig(
        model_registry=registry,
        state_dir=work / "cluster",
        cluster_id="cook" + uuid.uuid4().hex[:8],
        gateway_port=free_port(),
        scheduler_port=free_port(),
        worker_port_base=free_port(),
        state_store_port=free_port(),
        api_keys=f"{KEY}=cookbook",
        worker_threads=1,
    )
    cluster = LocalCluster(config)
    # Generous: on a loaded two-core machine four services importing torch take minutes.
    cluster.start(timeout_s=600)
    try:
        yield Recipes(cookbook, env, config.gateway_url, runs)
    finally:
        cluster.stop()


def test_sl_loop(recipes: Recipes) -> None:
    rows = recipes.run("sl_loop", "sl", "batch_size=4", "max_steps=2", "max_length=128")
    assert [row["step"] for row in rows] == [0, 1]
    # Each step is a new batch, so the loss need not fall in two steps; it must be a loss.
    nll = [row["train_mean_nll"] for row in rows]
    assert all(0 < v < 20 for v in nll), nll
    assert all("grad_norm:mean" in row for row in rows)  # optim_step answered every step


def test_rl_loop_with_its_default_loss(recipes: Recipes) -> None:
    # No loss_fn given: the recipe's default, stable_reinforce.
    rows = recipes.run(
        "rl_loop", "rl", "batch_size=4", "group_size=4", "max_tokens=8", "max_steps=3"
    )
    assert [row["step"] for row in rows] == [0, 1, 2]
    # A step trains only when some group's rewards differ; then the optimizer's metrics
    # are logged. The warmed model answers right about half the time.
    trained = [row for row in rows if "grad_norm:mean" in row]
    assert trained, f"no step trained (all advantages zero): {rows}"
    assert all(0.0 <= row["reward/total"] <= 1.0 for row in rows)


def test_math_rl_with_its_defaults(recipes: Recipes) -> None:
    # The default environment (arithmetic, generated by the recipe) and loss
    # (stable_reinforce). The warmed model ends some answers within the 5 tokens and not
    # others, so rewards differ by the format penalty and the loss sees real advantages.
    rows = recipes.run(
        "math_rl.train",
        "math",
        "groups_per_batch=2",
        "group_size=4",
        "max_steps=2",
        "eval_every=0",
        "behavior_if_log_dir_exists=delete",
    )
    assert rows, "math_rl logged nothing"
    trained = max(row.get("tokens/cumulative/trained", 0) for row in rows)
    assert trained > 0, f"math_rl trained on no tokens: {rows}"
    assert any(row.get("grad_norm:mean", 0) > 0 for row in rows), f"zero gradients: {rows}"
