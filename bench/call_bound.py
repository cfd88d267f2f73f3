"""The engine time of the largest call a tenant may send: the fairness bound's T.

One engine thread serves every tenant of a worker, so another tenant's call can wait
behind one dispatch: at most `max_calls_per_run` calls of `max_call_tokens` tokens each
(docs/security.md, "Fairness"). This measures T — the engine seconds of one
forward_backward and of one sample call at the token cap — on the tiny local model (or
a model directory given with --registry/--model) and prints the bound. Ends with one
JSON line.

    .venv/bin/python bench/call_bound.py                  # tiny model, CPU
    .venv/bin/python bench/call_bound.py --device cuda    # on a GPU
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from plexrl.limits import DEFAULT_LIMITS
from plexrl.messages import (
    Datum,
    ForwardBackwardInput,
    JobSpec,
    LoraSpec,
    LossFn,
    SampleInput,
    SamplingParams,
    TensorArray,
)
from plexrl.models import ModelRegistry, init_tiny
from plexrl.policy.config import PolicyConfig
from plexrl_worker.engine import EngineConfig, TorchEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry", type=Path, default=None)
    parser.add_argument("--model", default="plexrl/tiny-qwen3")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=DEFAULT_LIMITS.max_call_tokens)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        registry_dir = args.registry
        if registry_dir is None:
            registry_dir = Path(tmp)
            init_tiny(registry_dir / "tiny-qwen3")
        registry = ModelRegistry(registry_dir)
        info = registry.info(args.model)
        engine = TorchEngine(registry, EngineConfig(device=args.device))
        engine.create("job", JobSpec(base_model=args.model, lora=LoraSpec(rank=8), seed=1))

        length = info.max_positions
        rows = max(1, args.tokens // length)
        rng = random.Random(0)
        data = []
        for _ in range(rows):
            tokens = [rng.randrange(5, info.vocab_size) for _ in range(length)]
            targets = TensorArray.from_list(tokens[1:] + tokens[:1], "int64")
            data.append(Datum(tokens=tokens, loss_fn_inputs={"target_tokens": targets}))
        call = ForwardBackwardInput(data=data, loss_fn=LossFn.CROSS_ENTROPY)
        start = time.perf_counter()
        engine.forward_backward("job", call)
        fb_s = time.perf_counter() - start

        prompt = [rng.randrange(5, info.vocab_size) for _ in range(16)]
        samples = max(1, args.tokens // length)
        sample = SampleInput(
            prompt=prompt,
            num_samples=samples,
            params=SamplingParams(max_tokens=length - len(prompt), seed=1, stop_at_eos=False),
        )
        start = time.perf_counter()
        engine.sample("job", sample)
        sample_s = time.perf_counter() - start

    runs = PolicyConfig().max_calls_per_run
    worst = max(fb_s, sample_s)
    print(
        f"{args.model} on {args.device}: forward_backward of {rows * length} tokens "
        f"{fb_s:.2f}s, sample of {samples} x {length} tokens {sample_s:.2f}s; a call waits "
        f"behind one dispatch for at most {runs} x {worst:.2f}s = {runs * worst:.1f}s"
    )
    print(
        json.dumps(
            {
                "benchmark": "call_bound",
                "model": args.model,
                "device": args.device,
                "call_tokens": args.tokens,
                "forward_backward_s": round(fb_s, 3),
                "sample_s": round(sample_s, 3),
                "max_calls_per_run": runs,
                "bound_s": round(runs * worst, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
