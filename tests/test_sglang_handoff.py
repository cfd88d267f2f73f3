"""The SGLang sampler hands the device to training and takes it back (the rule only;
the real round trip through SGLang is in tests/test_sglang_worker.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from plexrl.messages import SampleInput, SampleOutput, SamplingParams
from plexrl_worker.engine import BASE_PREFIX
from plexrl_worker.samplers import SGLangSampling


class Server:
    """Stands in for one SGLangSampler: records releases, resumes and samples."""

    def __init__(self) -> None:
        self.released = False
        self.log: list[str] = []
        self.inside = threading.Event()
        self.go = threading.Event()
        self.go.set()

    def ensure_running(self) -> None:
        pass

    def release_memory(self) -> None:
        self.released = True
        self.log.append("release")

    def resume_memory(self) -> None:
        self.released = False
        self.log.append("resume")

    def sample(self, inp: SampleInput, adapter: str | None = None) -> SampleOutput:
        assert not self.released, "sampled on released memory"
        self.log.append("sample")
        self.inside.set()
        self.go.wait(10)
        return SampleOutput(sequences=[])


class Registry:
    def resolve(self, name: str) -> Path:
        return Path("/models") / name


def sampling(yield_device: bool) -> tuple[SGLangSampling, Server]:
    s = SGLangSampling(
        engine=Any,  # type: ignore[arg-type]  # the base model's path never touches it
        registry=Registry(),  # type: ignore[arg-type]
        workdir=Path("/nonexistent"),
        yield_device=yield_device,
    )
    server = Server()
    s._servers[Path("/models/tiny")] = server  # type: ignore[assignment]
    return s, server


INPUT = SampleInput(prompt=[1, 2], num_samples=1, params=SamplingParams(max_tokens=2))


def test_training_takes_the_memory_and_the_next_sample_takes_it_back() -> None:
    s, server = sampling(yield_device=True)
    assert s.release_for_training()
    assert not s.release_for_training()  # already released: nothing more to do
    s.sample(BASE_PREFIX + "tiny", INPUT)
    assert server.log == ["release", "resume", "sample"]


def test_a_running_sample_keeps_the_memory() -> None:
    s, server = sampling(yield_device=True)
    server.go.clear()
    call = threading.Thread(target=s.sample, args=(BASE_PREFIX + "tiny", INPUT))
    call.start()
    assert server.inside.wait(10)
    assert not s.release_for_training()  # a rollout tail still decodes
    server.go.set()
    call.join(10)
    assert s.release_for_training()
    assert server.log == ["sample", "release"]


def test_off_it_never_releases() -> None:
    s, server = sampling(yield_device=False)
    assert not s.release_for_training()
    s.sample(BASE_PREFIX + "tiny", INPUT)
    assert server.log == ["sample"]
