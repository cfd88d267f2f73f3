"""The Tinker SDKs and the tinker-cookbook that scripts/sdk_matrix.sh installs side by side
under .plexrl/sdk, and how a program runs with one of them.

Each side install is a folder put first on PYTHONPATH of `.venv`'s Python, so that folder's
`tinker` (or `tinker_cookbook`) wins while `.venv` supplies the dependencies (docs/sdk.md).
Used by tests/test_sdk_versions.py and tests/test_cookbook_recipes.py, and by
bench/sdk_minors.py and bench/recipes.py, which run the same programs outside pytest.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SDK_DIR = Path(os.environ.get("PLEXRL_SDK_DIR", ROOT / ".plexrl" / "sdk"))
IN_CI = os.environ.get("CI") == "true"

# The versions CI runs; keep in step with scripts/sdk_matrix.sh and docs/sdk.md.
OLDEST, NEWEST = "0.16.1", "0.38.0"
MIDDLE = ("0.22.7", "0.30.4")
COOKBOOK = "tinker-cookbook-0.6.1"

_SDK_FOLDER = re.compile(r"tinker-(\d+)\.(\d+)\.(\d+)")


def installed(name: str) -> Path | None:
    """The folder scripts/sdk_matrix.sh installed `name` into (`tinker-0.16.1`,
    `tinker-cookbook-0.6.1`), or None when it has not (no stamp: absent or half done)."""
    folder = SDK_DIR / name
    return folder if (folder / ".plexrl-stamp").is_file() else None


def side_install(name: str) -> Path:
    """`installed(name)` for a test: skipped when missing, except in CI, where the script
    runs first and a missing folder is a failure."""
    import pytest

    folder = installed(name)
    if folder is None:
        reason = f"{SDK_DIR / name} is not installed; run scripts/sdk_matrix.sh"
        if IN_CI:
            pytest.fail(reason + " (CI must run it before pytest)")
        pytest.skip(reason)
    return folder


def installed_sdks() -> list[str]:
    """Every SDK version with a side install here, oldest first."""
    found = []
    for folder in SDK_DIR.glob("tinker-*"):
        match = _SDK_FOLDER.fullmatch(folder.name)
        if match and installed(folder.name):
            found.append(tuple(int(part) for part in match.groups()))
    return [".".join(map(str, v)) for v in sorted(found)]


# The end-to-end loop (tests/sdk_loop.py) ------------------------------------------------


def tinker_cli(
    base_url: str,
    key: str | None,
    *args: str,
    home: Path | None = None,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """`tinker --format json ARGS`, this environment's SDK, as a user runs it: the URL and
    the key (None: whatever `tinker auth login` stored under `home`) from the environment;
    `stdin` what the user types."""
    env = {**os.environ, "TINKER_BASE_URL": base_url, "HF_HUB_OFFLINE": "1"}
    env.pop("TINKER_API_KEY", None)
    env.pop("PYTHONPATH", None)
    if key is not None:
        env["TINKER_API_KEY"] = key
    if home is not None:
        env["HOME"] = str(home)
    cmd = [sys.executable, "-m", "tinker.cli", "--format", "json", *args]
    return subprocess.run(cmd, env=env, input=stdin, capture_output=True, text=True, timeout=300)


def run_sdk_loop(
    sdk: Path,
    base_url: str,
    api_key: str,
    model: str,
    tokenizer_dir: Path,
    timeout_s: float,
    more: bool = False,
) -> subprocess.CompletedProcess[str]:
    """tests/sdk_loop.py against `base_url`, with the SDK in folder `sdk` (`more`: its
    wider set of calls too)."""
    env = {**os.environ, "PYTHONPATH": str(sdk), "HF_HUB_OFFLINE": "1"}
    env.pop("TINKER_BASE_URL", None)
    cmd = [sys.executable, str(ROOT / "tests" / "sdk_loop.py"), base_url, api_key, model]
    return subprocess.run(
        [*cmd, str(tokenizer_dir), *(["--more"] if more else [])],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
    )


def loop_result(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON line a successful tests/sdk_loop.py printed last."""
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# The cookbook's recipes -----------------------------------------------------------------

# A name in the cookbook's model table (renderer qwen3), served by the tiny Qwen3.
COOKBOOK_MODEL = "Qwen/Qwen3-8B"
# The default model of the multi-turn recipes (guess_number, twenty_questions, text_arena),
# whose renderers are the Qwen3.5 family's: served by a tiny Qwen3 with THINK_TOKENS and
# room for ten turns.
COOKBOOK_THINK_MODEL = "Qwen/Qwen3.5-4B"
THINK_MAX_POSITIONS = 4096


class RecipeFailed(RuntimeError):
    """A recipe exited non-zero or logged no metrics; the message ends with its output."""


@dataclass
class Recipes:
    """Runs tinker-cookbook recipes, unchanged, against one gateway."""

    cookbook: Path
    """The cookbook's side install."""
    env: dict[str, str]
    """The recipes' environment (cookbook_env)."""
    base_url: str
    runs: Path
    """Each run logs under runs/<name>."""
    scheduler_log: Path | None = None
    """The cluster's scheduler log, where a test reads what the scheduler made of a run."""

    def run(
        self, module: str, name: str, *args: str, timeout_s: float = 900
    ) -> list[dict[str, Any]]:
        """Run recipe `module` on COOKBOOK_MODEL with a LoRA of rank 4, `args` (chz
        `key=value`) besides; its metrics.jsonl rows."""
        common = (f"base_url={self.base_url}", f"model_name={COOKBOOK_MODEL}", "lora_rank=4")
        return self.run_as_is(module, name, *common, "save_every=0", *args, timeout_s=timeout_s)

    def run_as_is(
        self, module: str, name: str, *args: str, timeout_s: float = 900
    ) -> list[dict[str, Any]]:
        """Run recipe `module` with only `args` and a log path: its own model, renderer
        and LoRA rank, the gateway by TINKER_BASE_URL (for recipes whose config has no
        base_url); its metrics.jsonl rows."""
        log_path = self.runs / name
        cmd = [
            sys.executable,
            "-m",
            f"tinker_cookbook.recipes.{module}",
            f"log_path={log_path}",
            *args,
        ]
        env = {**self.env, "TINKER_BASE_URL": self.base_url}
        done = subprocess.run(
            cmd, env=env, cwd=self.runs, capture_output=True, text=True, timeout=timeout_s
        )
        output = (done.stdout + done.stderr)[-8000:]
        if done.returncode != 0:
            raise RecipeFailed(f"{module} failed ({done.returncode}):\n{output}")
        metrics = log_path / "metrics.jsonl"
        if not metrics.is_file():
            raise RecipeFailed(f"{module} wrote no {metrics}:\n{output}")
        return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


# What each tested recipe is given beyond base_url, model, lora_rank, save_every, log_path
# (docs/sdk.md): tiny batches, two or three steps.
SL_LOOP_ARGS = ("batch_size=4", "max_steps=2", "max_length=128")
RL_LOOP_ARGS = ("batch_size=4", "group_size=4", "max_tokens=8", "max_steps=3")
MATH_RL_ARGS = (
    "groups_per_batch=2",
    "group_size=4",
    "max_steps=2",
    "eval_every=0",
    "behavior_if_log_dir_exists=delete",
)


# guess_number is given only these and a log path: its own model (COOKBOOK_THINK_MODEL),
# renderer (qwen3_5_disable_thinking), LoRA rank (32) and max_tokens (64); one step of
# two groups of four ten-turn games, no evaluation.
GUESS_NUMBER_ARGS = (
    "batch_size=2",
    "group_size=4",
    "max_steps=1",
    "eval_every=0",
    "save_every=0",
    "behavior_if_log_dir_exists=delete",
)


def prepare_cookbook(
    cookbook: Path, work: Path, api_key: str, *, think: bool = False
) -> tuple[Path, dict[str, str]]:
    """Everything the recipes need offline, under `work`: a model registry holding the
    tiny Qwen3 as `COOKBOOK_MODEL`, warmed so RL groups disagree (tests/cookbook_data.py),
    its tokenizer in a Hugging Face cache under that name, and the hub data sets. With
    `think`, also a tiny Qwen3 with THINK_TOKENS and THINK_MAX_POSITIONS positions as
    `COOKBOOK_THINK_MODEL`, warmed on guess_number's turns. Returns the registry and the
    recipes' environment."""
    from plexrl import hf_cache
    from plexrl.models import TinyShape, init_tiny
    from tests import cookbook_data

    registry, hf, data = work / "models", work / "hf", work / "datasets"
    model_dir = init_tiny(registry / "tiny", aliases=[COOKBOOK_MODEL])
    questions = [row["question"] for row in cookbook_data.gsm8k(32)]
    examples = cookbook_data.rl_loop_examples(questions, answers=("1", "2"))
    examples += cookbook_data.arithmetic_examples(32)
    cookbook_data.warm(model_dir, examples, steps=80)
    hf_cache.register_all(model_dir, [COOKBOOK_MODEL], hf)
    if think:
        think_dir = init_tiny(
            registry / "tiny-think",
            name="plexrl/tiny-qwen3-think",
            aliases=[COOKBOOK_THINK_MODEL],
            shape=TinyShape(max_positions=THINK_MAX_POSITIONS),
            think_tokens=True,
        )
        cookbook_data.warm(think_dir, cookbook_data.guess_number_examples(think_dir, 24))
        hf_cache.register_all(think_dir, [COOKBOOK_THINK_MODEL], hf)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(cookbook), str(ROOT)]),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_CACHE": str(hf),
        "HF_DATASETS_CACHE": str(data),
        "TINKER_API_KEY": api_key,
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
    return registry, env
