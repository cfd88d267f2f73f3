"""An RLVR recipe over the Tinker SDK: a supervised warm-up, then GRPO with a verifiable reward.

The task is shifting every digit of a string by one (the tiny base learned to copy
digit strings in its warm-up, never to shift them); the reward is checked by code
(exact answer: 1, else half the fraction of digits in the right place). Nothing here
knows about PlexRL: it is what a user would write against any Tinker service.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import tinker
from tinker import types

CLEAR_GAIN = 0.05
"""How much a job's mean reward must rise, from its first RL steps to its last, for the
run to count as learning (the demo's exit status; bench/demo_robustness.py)."""

SOLVED = 0.9
"""A mean reward at which the task counts as solved: a job whose warm-up already taught
it this much has no room to rise by CLEAR_GAIN, and counts as learning if its RL steps
keep it there (`learned`)."""


def learned(first: float, last: float) -> bool:
    """Whether a job's RL steps learned, from its mean reward in its first RL steps and in
    its last: it rose by CLEAR_GAIN, or it ended solved (SOLVED) and fell by less than
    CLEAR_GAIN on the way (a warm-up that already solved the task leaves nothing to gain,
    but RL must not undo it)."""
    return last - first >= CLEAR_GAIN or (last >= SOLVED and first - last < CLEAR_GAIN)


@dataclass(frozen=True)
class RlvrConfig:
    """One job's recipe."""

    base_model: str = "plexrl/tiny-qwen3"
    rank: int = 16
    """LoRA rank."""
    task: str = "shift"
    """`shift`: write each of `digits` digits plus one, mod 10 ("shift 3907:" → "4018"). The
    base copies digit strings (its warm-up) but has never shifted one, so every job starts
    with room to learn, whatever the machine's numerics made of the base; learning it is
    a small remapping on top of copying, which LoRA picks up smoothly.
    `copy`: repeat the digits (the base may already do it perfectly: no room for RL).
    `multiply`: a×b for single digits (81 facts to memorise; too slow for the demo)."""
    digits: int = 4
    """Length of the digit strings (tasks `shift` and `copy`)."""
    sft_steps: int = 30
    """Supervised warm-up steps (cross_entropy)."""
    sft_batch: int = 16
    rl_steps: int = 25
    """GRPO steps (importance_sampling)."""
    prompts_per_step: int = 8
    group_size: int = 8
    """Samples per prompt; advantages are rewards minus the group mean."""
    learning_rate: float = 0.01
    """Adam's learning rate for the supervised warm-up."""
    rl_learning_rate: float | None = 0.003
    """Adam's learning rate for the GRPO steps (None: `learning_rate`). Lower than the
    warm-up's: at 0.01, jobs whose warm-up had nearly solved the task lost 0.07-0.14 of
    reward in their RL steps (bench/demo_robustness.py)."""
    max_tokens: int = 8
    reward_stall_s: float = 1.0
    """Seconds the verifier takes per step (a tool or sandbox call); the device is idle."""
    seed: int = 0


@dataclass
class JobResult:
    model_id: str = ""
    sft_losses: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def mean_reward(self, first: bool, k: int = 5) -> float:
        window = self.rewards[:k] if first else self.rewards[-k:]
        return sum(window) / max(len(window), 1)


def reward(answer: str, completion: str) -> float:
    """The verifier: 1 for the exact answer, else half the fraction of digits in place."""
    text = completion.strip()
    if text == answer:
        return 1.0
    right = sum(1 for a, b in zip(text, answer, strict=False) if a == b)
    return 0.5 * right / max(len(answer), len(text), 1)


class RlvrJob:
    def __init__(
        self,
        service: tinker.ServiceClient,
        config: RlvrConfig,
        on_step: Callable[[str, dict[str, float]], None] = lambda phase, stats: None,
        on_idle: Callable[[str, float], None] = lambda model_id, seconds: None,
    ) -> None:
        self._service = service
        self._config = config
        self._on_step = on_step
        self._on_idle = on_idle
        self._rng = random.Random(config.seed)

    def _problem(self) -> tuple[str, str]:
        if self._config.task == "copy":
            digits = "".join(self._rng.choice("0123456789") for _ in range(self._config.digits))
            return f"copy {digits}:", digits
        if self._config.task == "shift":
            digits = "".join(self._rng.choice("0123456789") for _ in range(self._config.digits))
            return f"shift {digits}:", "".join(str((int(d) + 1) % 10) for d in digits)
        a, b = self._rng.randint(1, 9), self._rng.randint(1, 9)
        return f"{a}*{b}=", str(a * b)

    def run(self) -> JobResult:
        c = self._config
        start = time.monotonic()
        client = self._service.create_lora_training_client(
            base_model=c.base_model, rank=c.rank, seed=c.seed
        ).result()
        tokenizer = client.get_tokenizer()
        eos = int(tokenizer.eos_token_id)
        result = JobResult(model_id=client.model_id)
        adam = types.AdamParams(learning_rate=c.learning_rate)
        rl_lr = c.learning_rate if c.rl_learning_rate is None else c.rl_learning_rate
        rl_adam = types.AdamParams(learning_rate=rl_lr)

        def encode(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

        for _ in range(c.sft_steps):
            batch = []
            for _ in range(c.sft_batch):
                prompt, answer = self._problem()
                p, a = encode(prompt), [*encode(answer), eos]
                seq = p + a
                batch.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(seq[:-1]),
                        loss_fn_inputs={
                            "target_tokens": seq[1:],
                            "weights": [0.0] * (len(p) - 1) + [1.0] * len(a),
                        },
                    )
                )
            fb = client.forward_backward(batch, "cross_entropy")
            optim = client.optim_step(adam)
            loss = fb.result().metrics["loss:sum"] / c.sft_batch
            optim.result()
            result.sft_losses.append(loss)
            self._on_step("sft", {"loss": loss})

        for _ in range(c.rl_steps):
            sampler = client.save_weights_and_get_sampling_client().result()
            problems = [self._problem() for _ in range(c.prompts_per_step)]
            params = types.SamplingParams(
                max_tokens=c.max_tokens, temperature=1.0, seed=self._rng.randrange(1 << 30)
            )
            futures = [
                sampler.sample(types.ModelInput.from_ints(encode(p)), c.group_size, params)
                for p, _ in problems
            ]
            samples = [f.result() for f in futures]
            # The verifier runs now; the job makes no call meanwhile, so say so.
            self._on_idle(client.model_id, c.reward_stall_s)
            time.sleep(c.reward_stall_s)
            data, rewards = self._grpo_data(problems, samples, encode, tokenizer.decode, eos)
            if data:
                fb = client.forward_backward(data, "importance_sampling")
                optim = client.optim_step(rl_adam)
                fb.result()
                optim.result()
            mean = sum(rewards) / len(rewards)
            result.rewards.append(mean)
            self._on_step("rl", {"reward": mean})
        result.wall_s = time.monotonic() - start
        return result

    def _grpo_data(
        self,
        problems: list[tuple[str, str]],
        samples: list[Any],
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        eos: int,
    ) -> tuple[list[types.Datum], list[float]]:
        data: list[types.Datum] = []
        rewards: list[float] = []
        for (prompt, answer), response in zip(problems, samples, strict=True):
            p = encode(prompt)
            group = [
                reward(answer, decode([t for t in s.tokens if t != eos]))
                for s in response.sequences
            ]
            rewards.extend(group)
            baseline = sum(group) / len(group)
            for seq, r in zip(response.sequences, group, strict=True):
                advantage = r - baseline
                if advantage == 0.0:
                    continue
                tokens = list(seq.tokens)
                full = p + tokens
                pad = [0.0] * (len(p) - 1)
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={
                            "target_tokens": full[1:],
                            "logprobs": pad + list(seq.logprobs),
                            "advantages": pad + [advantage] * len(tokens),
                        },
                    )
                )
        return data, rewards
