"""tinker-cookbook recipes' wall time per step on PlexRL, beside the same loop written
directly on the Tinker SDK (same model, batch, calls and steps), in one run.

    scripts/sdk_matrix.sh                # once: the cookbook's side install
    scripts/infra.sh up                  # Kafka and Redis
    .venv/bin/python bench/recipes.py [--threads 1]

One local cluster serves both. The recipes run unchanged (`python -m
tinker_cookbook.recipes.<name>`) with the tiny configs tests/test_cookbook_recipes.py
gives them, on the warmed tiny Qwen3 (tests/sdk_support.prepare_cookbook); their
per-step time is what they log themselves (`time_total` for sl_loop, `time/total` for
rl_loop and math_rl: from the step's start to its optim_step's answer). The direct loops
make the same calls per step with .venv's tinker (0.38.0, the one the cookbook runs on):

- sl_loop: one forward_backward (cross_entropy, batch_size chat rows, loss on the
  answer) and one optim_step.
- rl_loop: save_weights_and_get_sampling_client, one sample call per question
  (num_samples=group_size, max_tokens), reward = the \\boxed{} answer is right, groups
  with differing rewards become datums (with provenance), forward_backward
  (stable_reinforce), optim_step.
- math_rl: the same, with one sample call per group member (num_samples=1, as the
  cookbook's rollouts do), 5 tokens, reward = right answer + 0.1 x (stopped - 1), on the
  sums the recipe's arithmetic environment draws for the same batch (`math_problems`).

Ends with one JSON line: per recipe, each step's seconds and the mean for both, and how
many steps trained (an RL step whose groups all got equal rewards skips training).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.sdk_support, tests.cookbook_data

import numpy as np  # noqa: E402
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from plexrl_tools.cluster import ClusterConfig, LocalCluster  # noqa: E402
from tests import cookbook_data  # noqa: E402
from tests.sdk_support import (  # noqa: E402
    COOKBOOK,
    COOKBOOK_MODEL,
    MATH_RL_ARGS,
    RL_LOOP_ARGS,
    SL_LOOP_ARGS,
    Recipes,
    installed,
    prepare_cookbook,
)

KEY = "tml-bench-recipes"
RANK = 4
# The tiny configs (tests/sdk_support.py's *_ARGS), as the direct loops read them.
SL_BATCH, SL_STEPS, SL_LR = 4, 2, 1e-4
RL_BATCH, RL_GROUP, RL_TOKENS, RL_STEPS, RL_LR = 4, 4, 8, 3, 4e-5
MATH_GROUPS, MATH_GROUP, MATH_TOKENS, MATH_STEPS, MATH_LR = 2, 4, 5, 2, 1e-5
ADAM = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8}


def turn(role: str, text: str) -> str:
    """One message as the cookbook's qwen3 renderer writes it."""
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


class Text:
    """The tiny model's tokenizer, as the direct loops use it."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model_dir)
        end = self._tok.convert_tokens_to_ids("<|im_end|>")
        assert isinstance(end, int), end
        self.end = end
        """`<|im_end|>`, the qwen3 renderer's stop token."""

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, tokens: list[int]) -> str:
        return str(self._tok.decode(tokens))


def tensor(values: list[Any], dtype: Literal["int64", "float32"]) -> types.TensorData:
    return types.TensorData(data=values, dtype=dtype, shape=[len(values)])


# The direct loops: each returns every step's seconds -------------------------------------


def sl_direct(client: Any, text: Text, steps: int) -> tuple[list[float], int]:
    rows = cookbook_data.no_robots(16)
    times = []
    for step in range(steps):
        start = time.time()
        batch = []
        for row in rows[step * SL_BATCH : (step + 1) * SL_BATCH]:
            system, user, assistant = (m["content"] for m in row["messages"])
            prompt = text.encode(
                turn("system", system) + turn("user", user) + "<|im_start|>assistant\n"
            )
            answer = text.encode(f"{assistant}<|im_end|>")
            tokens, weights = prompt + answer, [0.0] * len(prompt) + [1.0] * len(answer)
            batch.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tensor(tokens[1:], "int64"),
                        "weights": tensor(weights[1:], "float32"),
                    },
                )
            )
        lr = SL_LR * max(0.0, 1.0 - step / (16 // SL_BATCH))
        fwd_bwd = client.forward_backward(batch, loss_fn="cross_entropy")
        optim = client.optim_step(types.AdamParams(learning_rate=lr, **ADAM))
        fwd_bwd.result()
        optim.result()
        times.append(time.time() - start)
    return times, len(times)


def rl_datums(prompt: list[int], sequences: list[Any], rewards: list[float]) -> list[types.Datum]:
    """One datum per sequence of a group whose rewards differ (stable_reinforce's inputs and
    provenance, as the cookbook's rl_loop builds them); none when they are all equal."""
    mean = sum(rewards) / len(rewards)
    if all(r == mean for r in rewards):
        return []
    datums = []
    ob_len = len(prompt) - 1
    for seq, reward in zip(sequences, rewards, strict=True):
        sampled = list(seq.tokens)
        n = ob_len + len(sampled)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(prompt + sampled[:-1]),
            loss_fn_inputs={
                "target_tokens": tensor([0] * ob_len + sampled, "int64"),
                "logprobs": tensor([0.0] * ob_len + list(seq.logprobs), "float32"),
                "advantages": tensor([0.0] * ob_len + [reward - mean] * (n - ob_len), "float32"),
            },
        )
        datums.append(
            datum.with_provenance(
                model_input=[
                    types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(prompt)),
                    types.SampledProvenanceSpan(
                        sequence_id=seq.sequence_id, length=len(sampled) - 1
                    ),
                ],
                loss_fn_inputs=[
                    types.PromptProvenanceSpan(
                        sequence_id=seq.sequence_id, offset=1, length=len(prompt) - 1
                    ),
                    types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(sampled)),
                ],
            )
        )
    return datums


def train_step(client: Any, datums: list[types.Datum], lr: float) -> bool:
    """forward_backward and optim_step on `datums`; False (no calls) when there are none:
    every group's rewards were equal, and the recipes skip the step's training too."""
    if not datums:
        return False
    fwd_bwd = client.forward_backward(datums, loss_fn="stable_reinforce")
    optim = client.optim_step(types.AdamParams(learning_rate=lr, **ADAM))
    fwd_bwd.result()
    optim.result()
    return True


def rl_direct(client: Any, text: Text, steps: int) -> tuple[list[float], int]:
    rows = cookbook_data.gsm8k(32)
    boxed = re.compile(r"\\boxed\{([^}]*)\}")
    times, trained = [], 0
    for step in range(steps):
        start = time.time()
        sampler = client.save_weights_and_get_sampling_client(record_stability_info=True).result()
        params = types.SamplingParams(max_tokens=RL_TOKENS, stop=[text.end])
        batch = rows[step * RL_BATCH : (step + 1) * RL_BATCH]
        prompts = [
            text.encode(
                cookbook_data.RL_LOOP_FEWSHOT
                + turn("user", row["question"] + cookbook_data.RL_LOOP_SUFFIX)
                + "<|im_start|>assistant\n"
            )
            for row in batch
        ]
        futures = [
            sampler.sample(
                prompt=types.ModelInput.from_ints(p), num_samples=RL_GROUP, sampling_params=params
            )
            for p in prompts
        ]
        datums = []
        for prompt, future, row in zip(prompts, futures, batch, strict=True):
            sequences = future.result().sequences
            truth = row["answer"].split("####")[-1].strip()
            rewards = []
            for seq in sequences:
                found = boxed.search(text.decode(seq.tokens))
                rewards.append(1.0 if found and found.group(1).strip() == truth else 0.0)
            datums += rl_datums(prompt, sequences, rewards)
        trained += train_step(client, datums, RL_LR)
        times.append(time.time() - start)
    return times, trained


def math_problems(step: int) -> list[tuple[int, int]]:
    """The sums the recipe's arithmetic environment poses in batch `step`: its draws are
    numpy's RandomState seeded with the batch index, two integers in [0, 100] a group."""
    rng = np.random.RandomState(step)
    problems = []
    for _ in range(MATH_GROUPS):
        x = int(rng.randint(0, 101))
        problems.append((x, int(rng.randint(0, 101))))
    return problems


def math_direct(client: Any, text: Text, steps: int) -> tuple[list[float], int]:
    times, trained = [], 0
    for step in range(steps):
        start = time.time()
        sampler = client.save_weights_and_get_sampling_client(record_stability_info=True).result()
        params = types.SamplingParams(max_tokens=MATH_TOKENS, stop=[text.end], temperature=1.0)
        problems = math_problems(step)
        groups = []
        for x, y in problems:
            prompt = text.encode(
                turn("user", "What is 4 + 5?")
                + turn("assistant", "9")
                + turn("user", f"What is {x} + {y}?")
                + "<|im_start|>assistant\n"
            )
            one = types.ModelInput.from_ints(prompt)
            calls = [
                sampler.sample(prompt=one, num_samples=1, sampling_params=params)
                for _ in range(MATH_GROUP)
            ]
            groups.append((x + y, prompt, calls))
        datums = []
        for answer, prompt, calls in groups:
            sequences = [call.result().sequences[0] for call in calls]
            rewards = []
            for seq in sequences:
                ints = re.findall(r"-?\d+", text.decode(seq.tokens).replace(",", ""))
                right = float(bool(ints) and int(ints[-1]) == answer)
                stopped = float(str(seq.stop_reason) == "stop")
                rewards.append(0.1 * (stopped - 1) + right)
            datums += rl_datums(prompt, sequences, rewards)
        trained += train_step(client, datums, MATH_LR)
        times.append(time.time() - start)
    return times, trained


def direct(base_url: str, name: str, model_dir: Path, steps: int) -> tuple[list[float], int]:
    """The direct loop `name` on a fresh LoRA training client for `steps` steps: each
    step's seconds, and how many steps trained."""
    text = Text(model_dir)
    service = tinker.ServiceClient(base_url=base_url, api_key=KEY)
    client = service.create_lora_training_client(base_model=COOKBOOK_MODEL, rank=RANK).result()
    loop = {"sl_loop": sl_direct, "rl_loop": rl_direct, "math_rl": math_direct}[name]
    return loop(client, text, steps)


# What the recipes log --------------------------------------------------------------------

RECIPES = {
    # name: (module, args, the metric its step time is logged under)
    "sl_loop": ("sl_loop", SL_LOOP_ARGS, "time_total"),
    "rl_loop": ("rl_loop", RL_LOOP_ARGS, "time/total"),
    "math_rl": ("math_rl.train", MATH_RL_ARGS, "time/total"),
}
STEPS = {"sl_loop": SL_STEPS, "rl_loop": RL_STEPS, "math_rl": MATH_STEPS}
"""Steps per recipe by default: the test's."""
MOST_STEPS = {"sl_loop": 16 // SL_BATCH, "rl_loop": 32 // RL_BATCH, "math_rl": 1000}
"""What the local data sets allow (tests/cookbook_data.write_all: 16 chat rows, 32
questions; the arithmetic environment draws its own)."""


def with_steps(recipe_args: tuple[str, ...], steps: int) -> tuple[str, ...]:
    return tuple(f"max_steps={steps}" if a.startswith("max_steps=") else a for a in recipe_args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the worker")
    parser.add_argument("--only", help="comma-separated recipe names (default: all three)")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps per recipe and direct loop (default: the test's, 2-3; at most what the\n"
        "local data allow: sl_loop 4, rl_loop 8)",
    )
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(RECIPES)
    cookbook = installed(COOKBOOK)
    if cookbook is None:
        sys.exit(f"{COOKBOOK} is not installed; run scripts/sdk_matrix.sh first")

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="plexrl-bench-recipes-") as tmp:
        work = Path(tmp)
        print("warming the tiny model (about two minutes)...", flush=True)
        registry, env = prepare_cookbook(cookbook, work, KEY)
        runs = work / "runs"
        runs.mkdir()
        config = ClusterConfig.on_free_ports(
            registry,
            work / "cluster",
            "recipes",
            api_keys=f"{KEY}=bench-recipes",
            worker_threads=args.threads,
        )
        with LocalCluster(config):
            recipes = Recipes(cookbook, env, config.gateway_url, runs)
            for name in names:
                module, recipe_args, metric = RECIPES[name]
                steps = min(args.steps or STEPS[name], MOST_STEPS[name])
                started = time.monotonic()
                rows = recipes.run(module, name, *with_steps(recipe_args, steps))
                process_s = time.monotonic() - started
                cookbook_steps = [row[metric] for row in rows if metric in row]
                trained = sum("grad_norm:mean" in row for row in rows)
                direct_steps, direct_trained = direct(
                    config.gateway_url, name, registry / "tiny", steps
                )
                results[name] = {
                    "cookbook_step_s": [round(s, 2) for s in cookbook_steps],
                    "direct_step_s": [round(s, 2) for s in direct_steps],
                    "cookbook_mean_s": round(statistics.mean(cookbook_steps), 2),
                    "direct_mean_s": round(statistics.mean(direct_steps), 2),
                    "cookbook_process_s": round(process_s, 1),
                    "cookbook_steps_trained": trained,
                    "direct_steps_trained": direct_trained,
                }
                print(f"{name}: {results[name]}", flush=True)

    head = f"{'recipe':<9} {'cookbook s/step':>16} {'direct s/step':>14} {'ratio':>6}"
    print(f"\n{head}  {'trained':<8} steps (cookbook vs direct)")
    for name, r in results.items():
        ratio = r["cookbook_mean_s"] / r["direct_mean_s"]
        r["ratio"] = round(ratio, 2)
        steps = f"{r['cookbook_step_s']} vs {r['direct_step_s']}"
        both_trained = f"{r['cookbook_steps_trained']}/{r['direct_steps_trained']}"
        print(
            f"{name:<9} {r['cookbook_mean_s']:>16.2f} {r['direct_mean_s']:>14.2f} "
            f"{ratio:>6.2f}  {both_trained:<8} {steps}"
        )
    print(json.dumps({"bench": "recipes", "threads": args.threads, "recipes": results}))


if __name__ == "__main__":
    main()
