"""The hub data sets the cookbook recipes load, made locally in the same format.

`datasets.load_dataset("openai/gsm8k", "main")` with no hub reachable (HF_HUB_OFFLINE=1)
reads the newest prepared copy under `$HF_DATASETS_CACHE/openai___gsm8k/main/<version>/
<hash>/`: one Arrow stream file per split plus `dataset_info.json`. `write_cached` lays
rows out exactly there, so the recipes run their own loading code unchanged.

Run with the `datasets` package first on the path (scripts/sdk_matrix.sh installs it
beside the cookbook); .venv does not have it:

    PYTHONPATH=.plexrl/sdk/tinker-cookbook-0.6.1:. .venv/bin/python -m tests.cookbook_data DIR
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

VERSION, HASH = "0.0.0", "plexrl0000000000"


def write_cached(
    cache: Path, repo_id: str, config: str, splits: dict[str, list[dict[str, Any]]]
) -> Path:
    """`splits`' rows as the prepared cache of `repo_id` (config `config`); its folder."""
    import datasets
    import pyarrow as pa
    from datasets.naming import camelcase_to_snakecase, filename_prefix_for_split

    namespace, name = repo_id.split("/")
    folder = cache / f"{namespace}___{camelcase_to_snakecase(name)}" / config / VERSION / HASH
    folder.mkdir(parents=True, exist_ok=True)
    split_infos = []
    features = None
    for split, rows in splits.items():
        # Straight to Arrow: an in-memory datasets.Dataset would be fingerprinted, which
        # pickles the table and fails with this pyarrow (MonthDayNano).
        table = pa.Table.from_pylist(rows)
        features = datasets.Features.from_arrow_schema(table.schema)
        arrow = folder / f"{filename_prefix_for_split(name, split)}.arrow"
        with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        split_infos.append(
            datasets.SplitInfo(
                name=split,
                num_examples=len(rows),
                num_bytes=arrow.stat().st_size,
                dataset_name=name,
            )
        )
    info = datasets.DatasetInfo(
        features=features,
        config_name=config,
        dataset_name=name,
        builder_name=name,
        version=VERSION,
        splits=datasets.SplitDict({s.name: s for s in split_infos}, dataset_name=name),
    )
    info.write_to_directory(str(folder))
    return folder


def no_robots(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Rows of HuggingFaceH4/no_robots: prompt, prompt_id, messages, category."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        prompt = f"What is {a}+{b}?"
        rows.append(
            {
                "prompt": prompt,
                "prompt_id": f"{i:064x}",
                "messages": [
                    {"role": "system", "content": "You add numbers."},
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": f"{a}+{b}={a + b}"},
                ],
                "category": "Open QA",
            }
        )
    return rows


def gsm8k(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Rows of openai/gsm8k (config main): question, and a worked answer ending `#### N`.

    Every answer is 1, which the warmed tiny model (warm_to_boxed_answers) says about
    half the time, so rl_loop's groups have rewards that differ."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a = rng.randint(2, 9)
        rows.append(
            {
                "question": f"Tom has {a} apples and eats {a - 1} of them. How many are left?",
                "answer": f"Tom has {a}-{a - 1}=<<{a}-{a - 1}=1>>1 apple left.\n#### 1",
            }
        )
    return rows


# The recipe's own prompt pieces (tinker_cookbook/recipes/rl_loop.py, 0.6.1).
RL_LOOP_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
RL_LOOP_FEWSHOT = (
    "<|im_start|>user\nHow many r's are in strawberry?" + RL_LOOP_SUFFIX + "<|im_end|>\n"
    "<|im_start|>assistant\nLet's spell the word out and number all the letters: 1) s 2) t "
    "3) r 4) a 5) w 6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. "
    "\\boxed{3}<|im_end|>\n"
)


def rl_loop_examples(questions: list[str], answers: tuple[str, ...]) -> list[tuple[str, str]]:
    """rl_loop's prompts (as its qwen3 renderer writes them), each answered `\\boxed{a}` for
    every `a` in `answers`."""
    return [
        (
            RL_LOOP_FEWSHOT
            + f"<|im_start|>user\n{question}{RL_LOOP_SUFFIX}<|im_end|>\n<|im_start|>assistant\n",
            f"\\boxed{{{answer}}}<|im_end|>",
        )
        for question in questions
        for answer in answers
    ]


def arithmetic_examples(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """math_rl's default arithmetic prompts (its few-shot `What is 4 + 5?` first), each
    answered once within the recipe's 5-token budget and once past it, so the format part
    of its reward differs within a group."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        x, y = rng.randint(0, 101), rng.randint(0, 101)
        prompt = (
            "<|im_start|>user\nWhat is 4 + 5?<|im_end|>\n<|im_start|>assistant\n9<|im_end|>\n"
            f"<|im_start|>user\nWhat is {x} + {y}?<|im_end|>\n<|im_start|>assistant\n"
        )
        examples += [(prompt, "7<|im_end|>"), (prompt, "7 7 7 7 7 7 7<|im_end|>")]
    return examples


# The recipe's own texts (tinker_cookbook/recipes/multiplayer_rl/guess_number/env.py, 0.6.1).
GUESS_NUMBER_SYSTEM = (
    "Your job is to guess a integer between 0 and 1024. You can output your guess with the "
    "format Guess: <guess> (without the angle brackets), and say nothing else. Then we will "
    "tell you whether you guess is too high, too low, or correct."
)
GUESS_NUMBER_FAIL = (
    "Failed to parse. Please output in the format Guess: <guess> (without the angle "
    "brackets), and say nothing else."
)


def guess_number_examples(model_dir: Path, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """guess_number's prompts after zero to nine earlier turns, as its default renderer
    (qwen3_5_disable_thinking) writes them, which the tiny model's think template
    reproduces; each answered once in the recipe's format (`Guess: N`, reward 0 or 1) and
    once not (`It is N`, the format penalty), so a group's games score differently. The
    earlier turns mix both, each followed by the recipe's reply, as in a real game."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        gold = rng.randint(0, 1023)
        turns: list[dict[str, str]] = [{"role": "system", "content": GUESS_NUMBER_SYSTEM}]
        for _ in range(rng.randint(0, 9)):
            guess = rng.randint(0, 1023)
            if rng.random() < 0.5:
                reply = "Too low" if guess < gold else "Too high"
                turns += [{"role": "player", "content": f"Guess: {guess}"}]
            else:
                reply = GUESS_NUMBER_FAIL
                turns += [{"role": "player", "content": f"It is {guess}"}]
            turns += [{"role": "user", "content": reply}]
        prompt = str(
            tok.apply_chat_template(
                turns, add_generation_prompt=True, tokenize=False, enable_thinking=False
            )
        )
        guess = rng.randint(0, 1023)
        examples += [(prompt, f"Guess: {guess}<|im_end|>"), (prompt, f"It is {guess}<|im_end|>")]
    return examples


def warm(model_dir: Path, examples: list[tuple[str, str]], steps: int = 80) -> float:
    """Fine-tune the tiny model in place on (prompt, completion) text pairs, loss on the
    completions only; returns the last loss.

    A random tiny model never writes `\\boxed{}` (every rl_loop reward is 0, so the
    recipe skips its training step) and never ends within math_rl's 5 tokens (every
    advantage is 0). Warmed on two answers per prompt (rl_loop_examples,
    arithmetic_examples), a group's samples disagree and the losses see real advantages.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng = random.Random(0)
    encoded = [
        (tok.encode(p, add_special_tokens=False), tok.encode(c, add_special_tokens=False))
        for p, c in examples
    ]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        # One padded batch a step (pad on the left, masked): the prompts differ by a few
        # tokens only.
        batch = rng.sample(encoded, min(8, len(encoded)))
        width = max(len(p) + len(c) for p, c in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, c) in enumerate(batch):
            n = len(p) + len(c)
            ids[i, width - n :] = torch.tensor(p + c)
            labels[i, width - len(c) :] = torch.tensor(c)
            mask[i, width - n :] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, labels=labels)
        loss = out.loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(model_dir)
    return float(loss.detach())


def write_all(cache: Path) -> None:
    """Every data set the tested recipes load (sl_loop, rl_loop), into `cache`."""
    splits = {"train": no_robots(16), "test": no_robots(4, seed=1)}
    write_cached(cache, "HuggingFaceH4/no_robots", "default", splits)
    write_cached(cache, "openai/gsm8k", "main", {"train": gsm8k(32), "test": gsm8k(4, seed=1)})


if __name__ == "__main__":
    write_all(Path(sys.argv[1]))
