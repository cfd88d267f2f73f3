"""Warm a tiny base model on synthetic digit tasks, so it is a base worth fine-tuning.

A randomly initialised model cannot learn a task in the few dozen LoRA steps of a
demo; a real base model knows how to copy and roughly how to count. This gives the
tiny model that much: next-token training on copying, counting and small sums,
deterministic for a seed (one thread, a seeded generator).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

WARM_STEPS = 1000
"""Warm-up steps of the demo's base: enough that copying up to COPY_MAX digits is learned
on every seed tried (bench/demo_robustness.py), not only on the lucky ones."""

COPY_MAX = 8
"""Longest string the warm-up copies; the demo's tasks stay within it."""


def synthetic_task(rng: random.Random) -> tuple[str, str]:
    """One (prompt, answer) pair of the warm-up mixture."""
    kind = rng.random()
    if kind < 0.4:
        x = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, COPY_MAX)))
        return f"copy {x}:", x
    if kind < 0.6:
        a = rng.randint(0, 98)
        return f"next {a}:", str(a + 1)
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"{a}+{b}=", str(a + b)


def _examples(tokenize: Callable[[str], list[int]], eos: int, seed: int) -> Iterator[list[int]]:
    rng = random.Random(seed)
    while True:
        prompt, answer = synthetic_task(rng)
        yield tokenize(prompt) + tokenize(answer) + [eos]


def pretrain(
    model_dir: Path,
    *,
    steps: int = WARM_STEPS,
    seed: int = 0,
    lr: float = 3e-3,
    batch_size: int = 32,
    progress: bool = True,
) -> float:
    """Train the model in `model_dir` in place; returns the last batch's mean token loss."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos = int(tokenizer.eos_token_id)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)

    def tokenize(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    examples = _examples(tokenize, eos, seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-identical results on any machine
    loss_value = float("nan")
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
            model.train()
            bar = tqdm(range(steps), desc="warming the tiny base", disable=not progress)
            for _ in bar:
                seqs = [next(examples) for _ in range(batch_size)]
                width = max(len(s) for s in seqs)
                ids = torch.full((batch_size, width), pad, dtype=torch.long)
                mask = torch.zeros((batch_size, width), dtype=torch.long)
                for i, s in enumerate(seqs):
                    ids[i, : len(s)] = torch.tensor(s)
                    mask[i, : len(s)] = 1
                labels = ids.masked_fill(mask == 0, -100)
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                loss_value = float(loss.detach())
                bar.set_postfix(loss=f"{loss_value:.3f}")
    finally:
        torch.set_num_threads(threads)
    model.eval()
    model.save_pretrained(model_dir)
    return loss_value
