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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from plexrl.models import init_tiny
from plexrl_tools.cluster import ClusterConfig, LocalCluster
from tests.sdk_support import (
    COOKBOOK,
    GUESS_NUMBER_ARGS,
    MATH_RL_ARGS,
    RL_LOOP_ARGS,
    SL_LOOP_ARGS,
    THINK_MAX_POSITIONS,
    Recipes,
    prepare_cookbook,
    side_install,
)

KEY = "tml-cookbook"

# What the Qwen3.5-family renderers (the default of most recipes) need of a tokenizer, run
# with the cookbook on the path: `</think>` and `<|im_end|>` one token each, a response
# parsed into its thinking and its text, and (for qwen3_5 and qwen3_5_disable_thinking)
# the same prompt tokens as the tokenizer's own chat template.
_RENDERERS_CHECK = """
import json, sys
from transformers import AutoTokenizer
from tinker_cookbook.renderers import get_renderer

CONVO = [
    {"role": "system", "content": "Guess a number. "},
    {"role": "user", "content": "Too low"},
    {"role": "assistant", "content": "Guess: 5"},
    {"role": "user", "content": "Too high"},
]
# Each renderer, and the enable_thinking of the chat template it matches (None: none).
RENDERERS = {
    "qwen3_5": True,
    "qwen3_5_disable_thinking": False,
    "qwen3_5_preserve_thinking": None,
    "qwen3_8_low_reasoning": None,
}


def check(tok, name, thinking):
    response = tok.encode("hm</think>\\n\\nGuess: 7<|im_end|>", add_special_tokens=False)
    try:
        renderer = get_renderer(name, tok)
        prompt = renderer.build_generation_prompt(CONVO).to_ints()
        message, _ = renderer.parse_response(response)
    except AssertionError as err:
        return f"AssertionError {err}"
    same = None
    if thinking is not None:
        template = tok.apply_chat_template(
            CONVO, add_generation_prompt=True, tokenize=False, enable_thinking=thinking
        )
        same = tok.encode(template, add_special_tokens=False) == prompt
    return {"content": message["content"], "same_as_template": same}


by_model = {}
for model_dir in sys.argv[1:]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    by_model[model_dir] = {name: check(tok, name, on) for name, on in RENDERERS.items()}
print(json.dumps(by_model))
"""


def test_the_qwen3_5_renderers_need_the_think_tokens(tmp_path: Path) -> None:
    cookbook = side_install(COOKBOOK)
    think = init_tiny(tmp_path / "think", think_tokens=True)
    plain = init_tiny(tmp_path / "plain")
    env = {**os.environ, "PYTHONPATH": str(cookbook), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _RENDERERS_CHECK, str(think), str(plain)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    by_model: dict[str, dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    found = by_model[str(think)]
    parsed = [{"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "Guess: 7"}]
    for name in ("qwen3_5", "qwen3_5_disable_thinking"):
        assert found[name] == {"content": parsed, "same_as_template": True}, found
    for name in ("qwen3_5_preserve_thinking", "qwen3_8_low_reasoning"):
        assert found[name]["content"] == parsed, found
    # Without them, `</think>` spelled out in bytes is several tokens, and every one of
    # these renderers fails its assertion on the first response it parses.
    without = by_model[str(plain)]
    assert all(str(v).startswith("AssertionError") for v in without.values()), without


@pytest.fixture(scope="module")
def recipes(infra: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recipes]:
    cookbook = side_install(COOKBOOK)
    work = tmp_path_factory.mktemp("cookbook")
    registry, env = prepare_cookbook(cookbook, work, KEY, think=True)
    runs = work / "runs"
    runs.mkdir()
    config = ClusterConfig.on_free_ports(
        registry, work / "cluster", "cook", api_keys=f"{KEY}=cookbook", worker_threads=1
    )
    cluster = LocalCluster(config)
    # Generous: on a loaded two-core machine four services importing torch take minutes.
    cluster.start(timeout_s=600)
    try:
        yield Recipes(cookbook, env, config.gateway_url, runs, cluster.logs()["scheduler"])
    finally:
        cluster.stop()


@pytest.mark.integration
def test_sl_loop(recipes: Recipes) -> None:
    rows = recipes.run("sl_loop", "sl", *SL_LOOP_ARGS)
    assert [row["step"] for row in rows] == [0, 1]
    # Each step is a new batch, so the loss need not fall in two steps; it must be a loss.
    nll = [row["train_mean_nll"] for row in rows]
    assert all(0 < v < 20 for v in nll), nll
    assert all("grad_norm:mean" in row for row in rows)  # optim_step answered every step


@pytest.mark.integration
def test_rl_loop_with_its_default_loss(recipes: Recipes) -> None:
    # No loss_fn given: the recipe's default, stable_reinforce.
    rows = recipes.run("rl_loop", "rl", *RL_LOOP_ARGS)
    assert [row["step"] for row in rows] == [0, 1, 2]
    # A step trains only when some group's rewards differ; then the optimizer's metrics
    # are logged. The warmed model answers right about half the time.
    trained = [row for row in rows if "grad_norm:mean" in row]
    assert trained, f"no step trained (all advantages zero): {rows}"
    assert all(0.0 <= row["reward/total"] <= 1.0 for row in rows)


@pytest.mark.integration
def test_math_rl_with_its_defaults(recipes: Recipes) -> None:
    # The default environment (arithmetic, generated by the recipe) and loss
    # (stable_reinforce). The warmed model ends some answers within the 5 tokens and not
    # others, so rewards differ by the format penalty and the loss sees real advantages.
    before = _taken_as_asynchronous(recipes)
    rows = recipes.run("math_rl.train", "math", *MATH_RL_ARGS)
    assert rows, "math_rl logged nothing"
    # Its synchronous loop samples and trains in turn: not taken as asynchronous.
    assert _taken_as_asynchronous(recipes) == before
    trained = max(row.get("tokens/cumulative/trained", 0) for row in rows)
    assert trained > 0, f"math_rl trained on no tokens: {rows}"
    assert any(row.get("grad_norm:mean", 0) > 0 for row in rows), f"zero gradients: {rows}"


@pytest.mark.integration
def test_math_rl_asynchronous(recipes: Recipes) -> None:
    # The recipe's asynchronous mode (max_steps_off_policy=1): it samples its next
    # groups on saved weights while it trains on the last ones, and never tells PlexRL
    # so; the scheduler learns it from its calls (an asynchronous job's training may
    # then yield to a neighbour's sample between micro-batches).
    # Five steps: its first four groups are sampled at once, and each later step's two
    # beside the training before it; how those calls fall against each other depends
    # on the machine's timing, so several steps give the overlap the scheduler needs
    # (a call of one lane arriving while the other lane's call is still open) more
    # than one chance to show.
    before = _taken_as_asynchronous(recipes)
    args = [a for a in MATH_RL_ARGS if not a.startswith("max_steps=")]
    rows = recipes.run(
        "math_rl.train", "math-async", *args, "max_steps=5", "max_steps_off_policy=1"
    )
    trained = max(row.get("tokens/cumulative/trained", 0) for row in rows)
    assert trained > 0, f"math_rl trained on no tokens: {rows}"
    learned = _taken_as_asynchronous(recipes)
    assert len(learned) == len(before) + 1, f"not taken as asynchronous once: {learned}"


def _taken_as_asynchronous(recipes: Recipes) -> list[str]:
    """The scheduler's lines for jobs it learned were asynchronous, so far."""
    assert recipes.scheduler_log is not None
    log = recipes.scheduler_log.read_text().splitlines()
    return [line for line in log if "samples while it trains: asynchronous" in line]


@pytest.mark.integration
def test_guess_number_multi_turn_with_its_default_model_and_renderer(recipes: Recipes) -> None:
    # Nothing but batch sizes, one step and no evaluation: the recipe's own model name
    # (Qwen/Qwen3.5-4B, served by the tiny Qwen3 with think tokens and 4096 positions),
    # its default renderer qwen3_5_disable_thinking (which asserts `</think>` is one
    # token), LoRA rank 32 and 64 tokens a turn, over up to ten turns a game.
    rows = recipes.run_as_is("multiplayer_rl.guess_number.train", "guess", *GUESS_NUMBER_ARGS)
    trained = [row for row in rows if "grad_norm:mean" in row]
    assert len(trained) == 1, f"the one step did not train: {rows}"
    (row,) = trained
    assert row["env/all/turns_per_episode"] > 1, row
    # The warmed model answers in the format (0) or not (-1), so every group is mixed.
    assert row["env/all/by_group/frac_mixed"] > 0 and row["grad_norm:mean"] > 0, row
    # Each turn's observation and action, from the recipe's own rollout summaries: the
    # later turns of a game are longer than a default tiny model's 512 positions.
    summaries = sorted((recipes.runs / "guess").rglob("*rollout*.jsonl"))
    assert summaries, f"no rollout summaries under {recipes.runs / 'guess'}"
    lengths = [
        step["ob_len"] + step["ac_len"]
        for path in summaries
        for line in path.read_text().splitlines()
        if line.strip()
        for step in json.loads(line)["steps"]
    ]
    assert 512 < max(lengths) <= THINK_MAX_POSITIONS, max(lengths)
