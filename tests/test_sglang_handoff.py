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

    def pause_generation(self, mode: str = "retract") -> None:
        self.log.append(f"pause:{mode}")

    def continue_generation(self) -> None:
        self.log.append("continue")

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
        weights=Any,  # type: ignore[arg-type]  # the base model's path never reads it
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


def test_a_preemption_pauses_every_server_and_continues_them() -> None:
    s, server = sampling(yield_device=True)
    other = Server()
    s._servers[Path("/models/other")] = other  # type: ignore[assignment]
    s.pause()
    s.resume()
    # retract: the running requests wait with their KV cache freed (on a GPU, room for
    # the preempting call), and finish with the same tokens once continued.
    assert server.log == other.log == ["pause:retract", "continue"]


class AdapterServer(Server):
    """Also keeps the adapters loaded, as SGLangSampler does."""

    def __init__(self) -> None:
        super().__init__()
        self.adapters: dict[str, str] = {}
        self.hold: str | None = None
        """Calls through this adapter wait for `go`; others return at once."""

    def sample(self, inp: SampleInput, adapter: str | None = None) -> SampleOutput:
        assert adapter in self.adapters, f"sampled through unloaded adapter {adapter}"
        if adapter == self.hold:
            self.inside.set()
            self.go.wait(10)
        assert adapter in self.adapters, f"{adapter} was unloaded under its call"
        return SampleOutput(sequences=[])

    def load_adapter(self, name: str, path: str | Path) -> None:
        self.adapters[name] = str(path)

    def unload_adapter(self, name: str) -> None:
        del self.adapters[name]


class LoraEngine:
    """Every sampler weights id is a rank-2 LoRA set of the tiny base."""

    def sampler_weights(self, weights_id: str) -> tuple[Any, Path, dict[str, Any]]:
        from plexrl.messages import JobSpec, LoraSpec

        return JobSpec(base_model="tiny", lora=LoraSpec(rank=2)), Path("/models/tiny"), {}


def test_adapters_beyond_the_bound_are_unloaded_least_recent_first_never_under_a_call(
    tmp_path: Path, monkeypatch: Any
) -> None:
    import plexrl_worker.samplers as samplers

    monkeypatch.setattr(samplers, "write_lora_adapter", lambda path, *a, **k: path)
    s = SGLangSampling(
        weights=LoraEngine().sampler_weights,
        registry=Registry(),  # type: ignore[arg-type]
        workdir=tmp_path,
        max_adapters=2,
    )
    server = AdapterServer()
    s._servers[Path("/models/tiny")] = server  # type: ignore[assignment]
    inp = SampleInput(prompt=[1, 2], num_samples=1, params=SamplingParams(max_tokens=2))
    for step in range(4):  # an RL loop: new sampler weights every step
        s.sample(f"tinker://run/sampler_weights/{step}", inp)
    assert len(server.adapters) == 2 == len(s.loaded_adapters)
    oldest, newest = s.loaded_adapters
    # A call in flight through the least recent adapter keeps it loaded while newer
    # ones come and go.
    server.hold, held = oldest, f"tinker://run/sampler_weights/{2}"
    server.go.clear()
    slow = threading.Thread(target=s.sample, args=(held, inp))
    slow.start()
    assert server.inside.wait(10)
    for step in range(4, 7):
        s.sample(f"tinker://run/sampler_weights/{step}", inp)
        assert oldest in server.adapters
    server.go.set()
    slow.join(10)
    assert len(server.adapters) == 2 and oldest in server.adapters
    assert newest not in server.adapters
