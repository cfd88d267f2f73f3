"""SGLangSampler: Tinker's `sample` served by an SGLang server child process.

Semantics, and where they differ from the torch sampler (plexrl_worker.engine.sampling):
- `logprobs` of a sampled token are SGLang's: log-softmax of the temperature-scaled logits,
  before top-k / top-p truncation; at temperature 0 (greedy) the plain log-softmax. That is
  the torch sampler's rule too.
- A sequence stops on a stop token, the end-of-sequence token (unless `stop_at_eos` is
  False), or a stop string; the token that ended it is kept in `tokens`.
- Draws come from SGLang's own generator: there are no per-request seeds on this device
  (SGLang takes `sampling_seed` only with --enable-deterministic-inference, a GPU feature),
  so a SampleInput with a seed raises SGLangUnsupportedError.
- Calls from several threads run at once and SGLang batches them (continuous batching,
  across LoRA adapters too).

The sampler remembers what it put into the server (the adapters, the last pushed weights,
released memory, paused generation) and puts it back after a restart, so a server that
died comes back serving the same weights.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx

from plexrl.messages import SampledSequence, SampleInput, SampleOutput, StopReason
from plexrl_worker.engine.errors import NotFoundError
from plexrl_worker.sglang.errors import SGLangServerError, SGLangUnsupportedError
from plexrl_worker.sglang.server import SGLangServer, SGLangServerConfig

PauseMode = Literal["abort", "retract", "in_place"]
"""SGLang's /pause_generation modes: `abort` (running requests end, aborted), `retract`
(they go back to the queue and their KV cache is recomputed on continue), `in_place`
(they stay in the batch with their KV cache)."""


class SGLangSampler:
    """One SGLang server and the sampler weights it serves.

    Thread-safe: `sample` may be called from many threads at once (that is how calls are
    co-batched); the control operations (adapters, weights, memory, pause) serialise.
    """

    def __init__(
        self,
        config: SGLangServerConfig,
        *,
        request_timeout_s: float = 600.0,
        max_restarts: int = 3,
    ) -> None:
        self.server = SGLangServer(config)
        self.model_path = config.model_path
        self._timeout = request_timeout_s
        self._max_restarts = max_restarts
        self._client = httpx.Client(timeout=request_timeout_s)
        self._lock = threading.RLock()
        self._adapters: dict[str, str] = {}
        self._weights_path: str | None = None
        self._released: list[str] | None = None
        self._paused: PauseMode | None = None

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the server (minutes on CPU), unless `launch` did, and wait until it
        generates."""
        with self._lock:
            self.server.start()

    def launch(self) -> None:
        """Start the server without waiting for it; `start` waits."""
        with self._lock:
            self.server.launch()

    def stop(self) -> None:
        """Stop the server, or, attached to one this process did not start, leave it
        running as it was found: this sampler's adapters unloaded, memory resumed,
        generation continued."""
        with self._lock:
            if self.server.attached and self.server.alive():
                with contextlib.suppress(SGLangServerError):
                    if self._paused is not None:
                        self.continue_generation()
                    if self._released is not None:
                        self.resume_memory()
                for name in list(self._adapters):
                    with contextlib.suppress(SGLangServerError):
                        self.unload_adapter(name)
            self.server.stop()
        self._client.close()

    def __enter__(self) -> SGLangSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def healthy(self) -> bool:
        """The server is alive and generates (SGLang's /health_generate)."""
        return self.server.healthy()

    @property
    def restarts(self) -> int:
        return max(0, self.server.starts - 1)

    def ensure_running(self) -> None:
        """Restart a server that died and put back what it served."""
        with self._lock:
            if self.server.alive():
                return
            if self.server.starts == 0:
                raise SGLangServerError("the SGLang sampler was not started; call start()")
            if self.restarts >= self._max_restarts:
                raise SGLangServerError(
                    f"the SGLang server died after {self.restarts} restarts; see "
                    f"{self.server.config.log_path or 'its log (set log_path to keep it)'}"
                )
            self.server.stop()
            self.server.start()
            self._restore()

    def _restore(self) -> None:
        if self._weights_path is not None:
            self._post("/update_weights_from_disk", {"model_path": self._weights_path})
        for name, path in self._adapters.items():
            self._post("/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if self._released is not None:
            self._post("/release_memory_occupation", {"tags": self._released or None})
        if self._paused is not None:
            self._post("/pause_generation", {"mode": self._paused})

    # -- sampling --------------------------------------------------------------------------

    def sample(self, inp: SampleInput, adapter: str | None = None) -> SampleOutput:
        """`inp.num_samples` continuations of `inp.prompt`, from the base weights (or the
        last pushed ones) or, with `adapter`, through that loaded LoRA adapter."""
        check_supported(inp)
        if adapter is not None and adapter not in self._adapters:
            raise NotFoundError(
                f"no LoRA adapter {adapter!r} is loaded in the SGLang sampler (loaded: "
                f"{', '.join(sorted(self._adapters)) or 'none'}); load_adapter() it first"
            )
        body = generate_request(inp, adapter)
        answers = self._post("/generate", body, retry_on_death=True)
        if not isinstance(answers, list):
            answers = [answers]
        cut_at = frozenset(inp.params.stop_tokens) if not inp.params.stop_at_eos else frozenset()
        sequences = [parse_sequence(a, cut_at) for a in answers]
        out = SampleOutput(sequences=sequences)
        if inp.prompt_logprobs or inp.topk_prompt_logprobs > 0:
            meta = answers[0]["meta_info"]
            out = SampleOutput(
                sequences=sequences,
                prompt_logprobs=prompt_logprobs(meta) if inp.prompt_logprobs else None,
                topk_prompt_logprobs=(
                    topk_prompt_logprobs(meta) if inp.topk_prompt_logprobs > 0 else None
                ),
            )
        return out

    # -- sampler weights ----------------------------------------------------------------------

    @property
    def adapters(self) -> dict[str, str]:
        """Loaded LoRA adapters: name → directory."""
        return dict(self._adapters)

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Load a PEFT-format adapter directory (files.write_lora_adapter writes one) under
        `name`; `sample(..., adapter=name)` then routes through it. Loading a name that is
        already loaded replaces it."""
        with self._lock:
            if name in self._adapters:
                self.unload_adapter(name)
            self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
            self._adapters[name] = str(path)

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            if name not in self._adapters:
                return
            self._post("/unload_lora_adapter", {"lora_name": name})
            del self._adapters[name]

    def push_weights(self, model_path: str | Path) -> None:
        """Replace the base weights in place from a directory of safetensors (the model's
        config beside them; files.write_full_weights writes one). No restart: running
        requests finish first, the prefix cache is flushed."""
        with self._lock:
            self._post("/update_weights_from_disk", {"model_path": str(model_path)})
            self._weights_path = str(model_path)

    # -- memory and preemption -----------------------------------------------------------------

    def release_memory(self, tags: Sequence[str] = ()) -> None:
        """Free the device memory of the weights and KV cache (`tags` narrows it to
        `weights` or `kv_cache`). On a GPU this needs `enable_memory_saver`; on CPU
        SGLang keeps the memory and the call only marks the engine as released."""
        with self._lock:
            self._post("/release_memory_occupation", {"tags": list(tags) or None})
            self._released = list(tags)

    @property
    def released(self) -> bool:
        """Whether its memory is released (`release_memory`) and not yet resumed."""
        return self._released is not None

    def resume_memory(self, tags: Sequence[str] = ()) -> None:
        with self._lock:
            self._post("/resume_memory_occupation", {"tags": list(tags) or None})
            self._released = None

    def pause_generation(self, mode: PauseMode = "retract") -> None:
        """Stop decoding (see PauseMode); control calls still run. Running `sample` calls
        wait (retract, in_place) or end with an error (abort)."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode {mode!r}; use abort, retract or in_place")
        with self._lock:
            self._post("/pause_generation", {"mode": mode})
            self._paused = mode

    def continue_generation(self) -> None:
        with self._lock:
            self._post("/continue_generation", {})
            self._paused = None

    # -- transport ---------------------------------------------------------------------------

    def _post(self, route: str, body: Mapping[str, Any], *, retry_on_death: bool = False) -> Any:
        attempts = 2 if retry_on_death else 1
        for attempt in range(1, attempts + 1):
            self.ensure_running()
            try:
                r = self._client.post(self.server.url + route, json=dict(body))
                break
            except httpx.TransportError as exc:
                # A dying server drops the connection a moment before its leader exits;
                # the next attempt restarts it.
                if attempt == attempts or not self.server.wait_exit(timeout_s=10.0):
                    raise SGLangServerError(f"SGLang {route} failed: {exc}") from exc
        if r.status_code >= 400:
            raise SGLangServerError(f"SGLang {route} answered {r.status_code}: {r.text[:500]}")
        if not r.content:
            return None
        answer = r.json()
        if isinstance(answer, dict) and answer.get("success") is False:
            raise SGLangServerError(f"SGLang {route} failed: {answer.get('message')}")
        return answer


def check_supported(inp: SampleInput) -> None:
    """Raise SGLangUnsupportedError, saying what to change, for what SGLang cannot do here."""
    if inp.params.seed is not None:
        raise SGLangUnsupportedError(
            "per-request seeds are not supported by the SGLang sampler on this device: "
            "SGLang honours sampling_seed only with --enable-deterministic-inference, which "
            "needs its GPU attention backends; drop `seed` from the sampling params, or run "
            "this job on a worker with PLEXRL_SAMPLER=torch"
        )


def generate_request(inp: SampleInput, adapter: str | None) -> dict[str, Any]:
    """The /generate body: one batch item per sample, so each is its own sequence."""
    p = inp.params
    sampling: dict[str, Any] = {
        "max_new_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "ignore_eos": not p.stop_at_eos,
        # Keep the stop string in the text; the tokens are returned whole either way.
        "no_stop_trim": True,
    }
    if p.stop_strings:
        sampling["stop"] = list(p.stop_strings)
    if p.stop_tokens and p.stop_at_eos:
        sampling["stop_token_ids"] = list(p.stop_tokens)
    # Else SGLang's ignore_eos would ignore stop_token_ids too: parse_sequence cuts at the
    # first stop token instead. The tokens before the cut are the same either way; only
    # the decode steps after it are wasted.
    n = inp.num_samples
    want_prompt = inp.prompt_logprobs or inp.topk_prompt_logprobs > 0
    body: dict[str, Any] = {
        "rid": [uuid.uuid4().hex for _ in range(n)],
        "input_ids": [list(inp.prompt) for _ in range(n)],
        "sampling_params": [dict(sampling) for _ in range(n)],
        "return_logprob": [True] * n,
        # -1: output tokens only; 0: the prompt's too (wanted once, from the first item).
        "logprob_start_len": [0 if want_prompt and i == 0 else -1 for i in range(n)],
    }
    if inp.topk_prompt_logprobs > 0:
        body["top_logprobs_num"] = [inp.topk_prompt_logprobs] * n
    if adapter is not None:
        body["lora_path"] = [adapter] * n
    return body


def parse_sequence(
    answer: Mapping[str, Any], cut_at: frozenset[int] = frozenset()
) -> SampledSequence:
    """One batch item of a /generate answer; `cut_at`: stop tokens SGLang did not stop on."""
    meta = answer["meta_info"]
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind == "abort":
        raise SGLangServerError(
            f"SGLang aborted the request: {finish.get('message') or finish}; "
            "it was paused with mode=abort or the server is shutting down"
        )
    tokens = [int(t) for t in answer["output_ids"]]
    logprobs = [float(lp) for lp, _token, *_ in meta["output_token_logprobs"]]
    if len(logprobs) != len(tokens):
        raise SGLangServerError(
            f"SGLang returned {len(tokens)} tokens but {len(logprobs)} logprobs"
        )
    reason = StopReason.LENGTH if kind == "length" else StopReason.STOP
    for i, token in enumerate(tokens):
        if token in cut_at:
            tokens, logprobs, reason = tokens[: i + 1], logprobs[: i + 1], StopReason.STOP
            break
    return SampledSequence(tokens=tokens, logprobs=logprobs, stop_reason=reason)


def prompt_logprobs(meta: Mapping[str, Any]) -> list[float | None]:
    """Per prompt position; the first prompt token has none."""
    return [None if lp is None else float(lp) for lp, _token, *_ in meta["input_token_logprobs"]]


def topk_prompt_logprobs(meta: Mapping[str, Any]) -> list[list[tuple[int, float]] | None]:
    out: list[list[tuple[int, float]] | None] = []
    for position in meta["input_top_logprobs"]:
        if not position:
            out.append(None)
        else:
            out.append([(int(token), float(lp)) for lp, token, *_ in position if lp is not None])
    return out
