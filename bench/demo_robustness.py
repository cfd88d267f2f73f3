"""Does the main job's recipe learn whatever the numerics? The recipe across seeds, in-process.

    .venv/bin/python bench/demo_robustness.py --bases 4 --jobs 3

`scripts/demo.sh` must show every job learning (`rlvr.learned`) on any machine, yet float results
differ between CPUs, thread counts and torch builds, and a small model amplifies such
differences into a different training run. This runs the demo's own recipe
(`examples/rlvr.py`, unchanged) on the worker's `TorchEngine` directly, without the
services (they do not change a job's numbers: the demo checks that its shared runs are
bit-identical to its runs alone), for several warmed bases (each warm-up seed a
different base, as a different machine's numerics would give) and several job seeds,
and reports each run's reward before and after RL. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from rlvr import RlvrConfig, RlvrJob, learned  # noqa: E402
from tinker import types  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from plexrl.messages import (  # noqa: E402
    AdamParams,
    Datum,
    ForwardBackwardInput,
    JobSpec,
    LoraSpec,
    LossFn,
    OptimStepInput,
    SampleInput,
    SamplingParams,
    TensorArray,
)
from plexrl.models import ModelRegistry, init_tiny  # noqa: E402
from plexrl_tools.pretrain import WARM_STEPS, pretrain  # noqa: E402
from plexrl_worker.engine import EngineConfig, TorchEngine  # noqa: E402
from plexrl_worker.engine.arrays import to_tensor  # noqa: E402


def _done(value: Any) -> Future[Any]:
    f: Future[Any] = Future()
    f.set_result(value)
    return f


class _Obj:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def _datum(d: types.Datum) -> Datum:
    inputs = {}
    for key, value in d.loss_fn_inputs.items():
        data = list(value.data)
        inputs[key] = (
            TensorArray.from_list(data, "int64")
            if key == "target_tokens"
            else TensorArray.from_list(data, "float32")
        )
    return Datum(tokens=d.model_input.to_ints(), loss_fn_inputs=inputs)


class EngineClient:
    """The slice of the tinker SDK's training and sampling clients the recipe calls."""

    def __init__(self, engine: TorchEngine, job_id: str, tokenizer_dir: Path) -> None:
        self._engine, self.model_id, self._tokenizer_dir = engine, job_id, tokenizer_dir

    def get_tokenizer(self) -> Any:
        return AutoTokenizer.from_pretrained(self._tokenizer_dir)

    def forward_backward(self, data: list[types.Datum], loss_fn: str) -> Future[Any]:
        out = self._engine.forward_backward(
            self.model_id, ForwardBackwardInput([_datum(d) for d in data], LossFn(loss_fn))
        )
        return _done(_Obj(metrics=out.metrics))

    def optim_step(self, adam: types.AdamParams) -> Future[Any]:
        params = AdamParams(
            learning_rate=adam.learning_rate, beta1=adam.beta1, beta2=adam.beta2, eps=adam.eps
        )
        return _done(self._engine.optim_step(self.model_id, OptimStepInput(params)))

    def save_weights_and_get_sampling_client(self) -> Future[EngineClient]:
        return _done(self)

    def sample(self, prompt: types.ModelInput, n: int, p: types.SamplingParams) -> Future[Any]:
        params = SamplingParams(
            max_tokens=p.max_tokens or 16, temperature=p.temperature, seed=p.seed
        )
        out = self._engine.sample(self.model_id, SampleInput(prompt.to_ints(), n, params))
        seqs = [
            _Obj(
                tokens=list(s.tokens),
                logprobs=to_tensor(s.logprobs).tolist()
                if isinstance(s.logprobs, TensorArray)
                else list(s.logprobs or []),
            )
            for s in out.sequences
        ]
        return _done(_Obj(sequences=seqs))


class EngineService:
    def __init__(self, engine: TorchEngine, model_dir: Path) -> None:
        self._engine, self._dir = engine, model_dir

    def create_lora_training_client(self, base_model: str, rank: int, seed: int) -> Future[Any]:
        job_id = f"job-{len(self._engine.resident_jobs())}"
        self._engine.create(
            job_id, JobSpec(base_model=base_model, lora=LoraSpec(rank=rank), seed=seed)
        )
        return _done(EngineClient(self._engine, job_id, self._dir))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bases", type=int, default=3, help="warmed bases (warm-up seeds 0..N-1)")
    p.add_argument("--jobs", type=int, default=3, help="job seeds per base (0..N-1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the engine")
    p.add_argument("--warm-steps", type=int, default=WARM_STEPS, help="warm-up steps of a base")
    p.add_argument("--digits", type=int, default=RlvrConfig.digits)
    p.add_argument("--first-base", type=int, default=0, help="warm-up seed of the first base")
    p.add_argument("--task", default=RlvrConfig.task, help="the recipe's task (multiply, copy)")
    p.add_argument("--lr", type=float, default=RlvrConfig.learning_rate)
    p.add_argument("--rl-lr", type=float, default=RlvrConfig.rl_learning_rate)
    p.add_argument("--sft-steps", type=int, default=RlvrConfig.sft_steps)
    p.add_argument("--rl-steps", type=int, default=RlvrConfig.rl_steps)
    args = p.parse_args()
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for base_seed in range(args.first_base, args.first_base + args.bases):
            model_dir = Path(tmp) / f"base-{base_seed}" / "tiny-qwen3"
            init_tiny(model_dir)
            pretrain(model_dir, steps=args.warm_steps, seed=base_seed, progress=False)
            engine = TorchEngine(
                ModelRegistry(model_dir.parent), EngineConfig(num_threads=args.threads)
            )
            for job_seed in range(args.jobs):
                config = RlvrConfig(
                    task=args.task,
                    digits=args.digits,
                    learning_rate=args.lr,
                    rl_learning_rate=args.rl_lr,
                    sft_steps=args.sft_steps,
                    rl_steps=args.rl_steps,
                    reward_stall_s=0.0,
                    seed=job_seed,
                )
                result = RlvrJob(EngineService(engine, model_dir), config).run()
                run = {
                    "base_seed": base_seed,
                    "job_seed": job_seed,
                    "sft_loss_last": round(result.sft_losses[-1], 3),
                    "reward_first": round(result.mean_reward(first=True), 3),
                    "reward_last": round(result.mean_reward(first=False), 3),
                }
                run["learned"] = learned(run["reward_first"], run["reward_last"])
                runs.append(run)
                print(run, flush=True)
    ok = sum(r["learned"] for r in runs)
    gains = sorted(r["reward_last"] - r["reward_first"] for r in runs)
    median = gains[len(gains) // 2]
    print(f"{ok}/{len(runs)} runs learned; smallest gain {gains[0]:+.3f}, median {median:+.3f}")
    print(
        json.dumps(
            {
                "benchmark": "demo_robustness",
                "runs": len(runs),
                "learned": ok,
                "min_gain": round(gains[0], 3),
                "median_gain": round(gains[len(gains) // 2], 3),
                "sft_steps": args.sft_steps,
                "rl_steps": args.rl_steps,
                "learning_rate": args.lr,
                "rl_learning_rate": args.rl_lr,
                "wall_s": round(time.monotonic() - started, 1),
            }
        )
    )
    return 0 if ok == len(runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
