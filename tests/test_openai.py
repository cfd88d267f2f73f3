"""The OpenAI-compatible API through the official `openai` client, and through an
evaluation client PlexRL did not write (EleutherAI's lm-evaluation-harness, installed
beside .venv by scripts/eval_client.sh), against all four services on the real Kafka and
Redis, over a tiny model built here.

On the session's shared cluster, whose registry holds the tiny Qwen3 (with aliases and
its ChatML template) and a copy whose tokenizer has no chat template.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import openai
import pytest
import tinker
from tinker import types
from transformers import AutoTokenizer

from plexrl_tools.cluster import ClusterConfig, LocalCluster
from tests.conftest import SHARED_ALIASES, SHARED_NO_CHAT

pytestmark = pytest.mark.integration

KEY = "tml-openai"
TENANT = "openai"
BASE = "plexrl/tiny-qwen3"
ALIAS = "Qwen/Qwen3-0.6B"
NO_CHAT = "plexrl/tiny-nochat"

ROOT = Path(__file__).resolve().parent.parent
LM_EVAL = Path(os.environ.get("PLEXRL_EVAL_DIR", ROOT / ".plexrl" / "eval")) / "lm-eval-0.4.13"
"""Keep in step with scripts/eval_client.sh."""


@dataclass(frozen=True)
class Served:
    config: ClusterConfig
    registry: Path

    @property
    def oai_url(self) -> str:
        return f"{self.config.gateway_url}/oai/api/v1"

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.oai_url, api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def served(shared_services: LocalCluster, shared_registry: Path) -> Served:
    """The session's shared cluster: its tiny Qwen3 also answers to ALIAS, and NO_CHAT is
    a copy whose tokenizer has no chat template (tests/conftest.py)."""
    assert ALIAS in SHARED_ALIASES and NO_CHAT == SHARED_NO_CHAT
    assert AutoTokenizer.from_pretrained(shared_registry / "nochat").chat_template is None
    return Served(shared_services.config, shared_registry)


def test_models_lists_served_names_and_aliases(served: Served) -> None:
    models = {m.id: m for m in served.client().models.list()}
    assert {BASE, ALIAS, NO_CHAT} <= set(models)
    assert models[BASE].object == "model" and models[BASE].owned_by == "plexrl"
    assert served.client().models.retrieve(ALIAS).id == ALIAS


def test_completion_with_seed_is_deterministic_and_counts_usage(served: Served) -> None:
    client = served.client()
    tok = AutoTokenizer.from_pretrained(served.registry / "tiny")
    prompt = "Q: What is 12 + 7? A:"

    def once() -> openai.types.Completion:
        return client.completions.create(
            model=BASE, prompt=prompt, max_tokens=12, temperature=1.0, seed=7, logprobs=0
        )

    first, second = once(), once()
    assert first.choices[0].text == second.choices[0].text
    assert first.object == "text_completion" and first.model == BASE
    assert first.choices[0].finish_reason in ("length", "stop")
    assert first.usage is not None
    assert first.usage.prompt_tokens == len(tok.encode(prompt))
    assert 1 <= first.usage.completion_tokens <= 12
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    lp = first.choices[0].logprobs
    assert lp is not None and lp.token_logprobs and all(v <= 0 for v in lp.token_logprobs)
    assert "".join(lp.tokens or []).startswith(first.choices[0].text[:1])
    # Another seed samples other tokens (a tiny random model at T=1 almost surely differs).
    other = client.completions.create(
        model=ALIAS, prompt=prompt, max_tokens=12, temperature=1.0, seed=8
    )
    assert other.choices[0].text != first.choices[0].text


def test_stop_sequences_cut_the_text_before_the_stop(served: Served) -> None:
    client = served.client()
    kwargs = {"model": BASE, "prompt": "copy: abc ->", "max_tokens": 24, "seed": 3}
    full = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    # A stop string from the middle of what that seed samples: the same seed, cut there.
    visible = [i for i in range(2, len(full) - 1) if not full[i : i + 2].isspace()]
    assert visible, f"no stop string to pick from {full!r}"
    stop = full[visible[0] : visible[0] + 2]
    cut = client.completions.create(stop=[stop, "\x00never"], **kwargs)  # type: ignore[call-overload]
    assert cut.choices[0].text == full[: full.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_n_and_several_prompts_give_one_choice_per_sample(served: Served) -> None:
    out = served.client().completions.create(
        model=BASE, prompt=["1+1=", "2+2="], n=3, max_tokens=4, seed=11
    )
    assert [c.index for c in out.choices] == list(range(6))
    texts = [c.text for c in out.choices]
    assert len(set(texts[:3])) > 1  # the samples of one prompt are drawn apart
    assert out.usage is not None and out.usage.completion_tokens <= 6 * 4


def test_chat_completion_and_its_stream_say_the_same(served: Served) -> None:
    client = served.client()
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 3 + 4?"},
    ]
    done = client.chat.completions.create(
        model=BASE, messages=messages, max_tokens=10, seed=5, logprobs=True
    )
    message = done.choices[0].message
    assert done.object == "chat.completion" and message.role == "assistant"
    assert isinstance(message.content, str)
    tok = AutoTokenizer.from_pretrained(served.registry / "tiny")
    as_dicts = [{"role": str(m["role"]), "content": str(m.get("content"))} for m in messages]
    rendered = tok.apply_chat_template(as_dicts, add_generation_prompt=True, tokenize=False)
    assert done.usage is not None
    assert done.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    content = done.choices[0].logprobs and done.choices[0].logprobs.content
    assert content and all(t.logprob <= 0 and t.top_logprobs == [] for t in content)

    chunks = list(
        client.chat.completions.create(
            model=BASE,
            messages=messages,
            max_tokens=10,
            seed=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == done.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == done.usage


def test_a_raw_stream_ends_with_done(served: Served) -> None:
    body = {"model": BASE, "prompt": "1+2=", "max_tokens": 3, "seed": 1, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", f"{served.oai_url}/completions", json=body, headers=headers, timeout=300
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_a_sampler_checkpoint_is_a_model(served: Served) -> None:
    service = tinker.ServiceClient(base_url=served.config.gateway_url, api_key=KEY)
    trainer = service.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    tok = AutoTokenizer.from_pretrained(served.registry / "tiny")
    tokens = tok.encode("12+7=19", add_special_tokens=False)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64")},
    )
    trainer.forward_backward([datum], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = trainer.save_weights_for_sampler(name="oai").result().path
    assert path.startswith("tinker://") and "/sampler_weights/" in path

    client = served.client()
    assert path in {m.id for m in client.models.list()}
    kwargs = {"prompt": "12+7=", "max_tokens": 6, "seed": 2, "temperature": 1.0}
    mine = client.completions.create(model=path, **kwargs)  # type: ignore[call-overload]
    assert mine.model == path and mine.choices[0].text
    # `<base>;<path>` names the same weights.
    both = client.completions.create(model=f"{BASE};{path}", **kwargs)  # type: ignore[call-overload]
    assert both.choices[0].text == mine.choices[0].text
    # A save_state checkpoint (weights with optimizer state) samples the same weights.
    state = trainer.save_state(name="oai-state").result().path
    from_state = client.completions.create(model=state, **kwargs)  # type: ignore[call-overload]
    assert from_state.choices[0].text == mine.choices[0].text
    # The calls were scheduled as the tenant's, under the training model's job.
    timeline = httpx.get(
        f"{served.config.gateway_url}/plexrl/v1/timeline", headers={"X-API-Key": KEY}
    ).json()
    ran = [e for e in timeline if e["job_id"] == trainer.model_id and e["function"] == "sample"]
    assert len(ran) >= 3


LOGPROB_TOL = 1e-5
"""How far two passes' logprobs of the same tokens may differ: the sampler's decode steps
against a scoring pass over the whole sequence, on the CPU engine in float32. Measured:
at most 4.8e-7 (one float32 ulp near -5..-12) at temperature 0 and 1; the scoring pass
and the SDK's compute_logprobs agree exactly."""


def _close(got: list[float | None], want: list[float | None]) -> None:
    assert len(got) == len(want)
    assert [g is None for g in got] == [w is None for w in want]
    diffs = [abs(g - w) for g, w in zip(got, want, strict=True) if g is not None and w is not None]
    assert max(diffs, default=0.0) <= LOGPROB_TOL, (max(diffs), got, want)


def _sampler(served: Served) -> tinker.SamplingClient:
    service = tinker.ServiceClient(base_url=served.config.gateway_url, api_key=KEY)
    return service.create_sampling_client(base_model=BASE).result()


def test_top_logprobs_of_a_completion_come_from_a_scoring_pass_that_agrees_with_the_sampler(
    served: Served,
) -> None:
    client = served.client()
    tok = AutoTokenizer.from_pretrained(served.registry / "tiny")
    prompt = "The capital of France is"
    kwargs = {"model": BASE, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    greedy = client.completions.create(logprobs=5, **kwargs)  # type: ignore[call-overload]
    lp = greedy.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(lp.tokens)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # Greedy: the chosen token is the likeliest, so it is among the five, first.
        assert 1 <= len(top) <= 5 and top[token] == value == max(top.values())
        assert list(top.values()) == sorted(top.values(), reverse=True)
    # The sampler's own logprobs of the same (greedy) tokens, without the scoring pass.
    plain = client.completions.create(logprobs=0, **kwargs)  # type: ignore[call-overload]
    assert plain.choices[0].logprobs is not None
    assert plain.choices[0].logprobs.tokens == lp.tokens
    assert plain.choices[0].logprobs.top_logprobs is None
    _close(list(plain.choices[0].logprobs.token_logprobs or []), list(lp.token_logprobs))
    # Tinker's compute_logprobs over the same token ids, through the SDK.
    ids = tok.encode(prompt)
    sampler = _sampler(served)
    sampled = sampler.sample(
        types.ModelInput.from_ints(ids), 1, types.SamplingParams(max_tokens=8, temperature=0.0)
    ).result()
    completion = list(sampled.sequences[0].tokens)
    assert [tok.decode([t]) for t in completion] == lp.tokens
    sdk = sampler.compute_logprobs(types.ModelInput.from_ints(ids + completion)).result()
    _close(list(lp.token_logprobs), sdk[len(ids) :])
    # At temperature 1 the sampler's logprobs are the model's too: the same seed, the same
    # tokens, with and without the scoring pass.
    hot = {**kwargs, "temperature": 1.0, "seed": 9}
    with_top = client.completions.create(logprobs=3, **hot)  # type: ignore[call-overload]
    without = client.completions.create(logprobs=0, **hot)  # type: ignore[call-overload]
    a, b = with_top.choices[0].logprobs, without.choices[0].logprobs
    assert a is not None and b is not None and a.tokens == b.tokens and a.top_logprobs
    _close(list(a.token_logprobs or []), list(b.token_logprobs or []))
    for token, value, top in zip(
        a.tokens or [], a.token_logprobs or [], a.top_logprobs, strict=True
    ):
        assert top[token] == value and len(top) <= 4  # the chosen token joins the three


def test_echo_puts_the_prompt_and_its_logprobs_first(served: Served) -> None:
    client = served.client()
    tok = AutoTokenizer.from_pretrained(served.registry / "tiny")
    prompt = "Q: What is 2 + 2? A: 4"
    ids = tok.encode(prompt)
    scored = client.completions.create(
        model=BASE, prompt=prompt, max_tokens=0, echo=True, logprobs=2
    )
    only = scored.choices[0]
    assert only.text == prompt and only.finish_reason == "length"
    lp = only.logprobs
    assert lp is not None and lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == prompt and lp.text_offset == [
        len("".join(lp.tokens[:i])) for i in range(len(ids))
    ]
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert scored.usage is not None
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (len(ids), 0)
    _close(
        list(lp.token_logprobs),
        _sampler(served).compute_logprobs(types.ModelInput.from_ints(ids)).result(),
    )
    # lm-eval's loglikelihood request: token ids, one greedy token after them.
    lm = client.completions.create(
        model=BASE, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234
    )
    lm_lp = lm.choices[0].logprobs
    assert lm_lp is not None and lm_lp.token_logprobs is not None and lm_lp.top_logprobs
    assert lm.choices[0].text.startswith(prompt) and len(lm_lp.token_logprobs) == len(ids) + 1
    _close(list(lm_lp.token_logprobs[: len(ids)]), list(lp.token_logprobs))
    assert lm_lp.token_logprobs[-1] == max(lm_lp.top_logprobs[-1].values())
    # Echo with logprobs 0 needs no scoring pass: the sample call scores its prompt.
    zero = client.completions.create(
        model=BASE, prompt=[prompt, prompt], max_tokens=3, echo=True, logprobs=0, n=2, seed=4
    )
    assert len(zero.choices) == 4 and zero.usage is not None
    assert zero.usage.prompt_tokens == 2 * len(ids)
    for c in zero.choices:
        assert c.text.startswith(prompt) and c.logprobs is not None
        assert c.logprobs.top_logprobs is None and c.logprobs.token_logprobs is not None
        _close(list(c.logprobs.token_logprobs[: len(ids)]), list(lp.token_logprobs))
        assert len(c.logprobs.token_logprobs) > len(ids)
    plain = client.completions.create(model=BASE, prompt=ids, max_tokens=2, echo=True, seed=4)
    assert plain.choices[0].logprobs is None and plain.choices[0].text.startswith(prompt)
    # A stream waits for the scoring pass too, and says the same.
    streamed = list(
        client.completions.create(
            model=BASE, prompt=prompt, max_tokens=0, echo=True, logprobs=2, stream=True
        )
    )
    assert streamed[0].choices[0].text == prompt
    assert streamed[0].choices[0].logprobs == lp


def test_chat_top_logprobs_list_the_alternatives_of_each_token(served: Served) -> None:
    client = served.client()
    kwargs = {
        "model": BASE,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 6,
        "temperature": 0.0,
        "logprobs": True,
    }
    done = client.chat.completions.create(top_logprobs=3, **kwargs)  # type: ignore[call-overload]
    content = done.choices[0].logprobs and done.choices[0].logprobs.content
    assert content
    for item in content:
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 3
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert (item.top_logprobs[0].token, values[0]) == (item.token, item.logprob)
    plain = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    plain_content = plain.choices[0].logprobs and plain.choices[0].logprobs.content
    assert plain_content and [t.token for t in plain_content] == [t.token for t in content]
    assert all(t.top_logprobs == [] for t in plain_content)
    _close([t.logprob for t in plain_content], [t.logprob for t in content])


def test_errors_are_shaped_as_openai_errors(served: Served) -> None:
    client = served.client()
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="acme/nonexistent", prompt="hi", max_tokens=2)
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    assert BASE in missing.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(
            model="tinker://nope:train:0/sampler_weights/x", prompt="hi", max_tokens=2
        )
    with pytest.raises(openai.AuthenticationError) as denied:
        served.client("tml-wrong").completions.create(model=BASE, prompt="hi", max_tokens=2)
    assert denied.value.code == "invalid_api_key"
    with pytest.raises(openai.BadRequestError) as tools:
        client.chat.completions.create(
            model=BASE,
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )
    assert tools.value.param == "tools" and tools.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as top:
        client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=21
        )
    assert top.value.param == "top_logprobs" and "between 0 and 20" in top.value.message
    with pytest.raises(openai.BadRequestError) as many:
        client.completions.create(model=BASE, prompt="hi", max_tokens=2, logprobs=6)
    assert many.value.param == "logprobs"
    with pytest.raises(openai.BadRequestError) as nothing:
        client.completions.create(model=BASE, prompt="hi", max_tokens=0)
    assert nothing.value.param == "max_tokens" and "echo" in nothing.value.message
    with pytest.raises(openai.BadRequestError) as no_template:
        client.chat.completions.create(model=NO_CHAT, messages=[{"role": "user", "content": "hi"}])
    assert no_template.value.code == "no_chat_template"
    assert "no chat template" in no_template.value.message
    with pytest.raises(openai.BadRequestError) as hot:
        client.completions.create(model=BASE, prompt="hi", temperature=3.0)
    assert hot.value.param == "temperature"
    raw = httpx.post(
        f"{served.oai_url}/completions",
        json={"model": BASE},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert raw.status_code == 400 and set(raw.json()["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }


# An evaluation client nobody here wrote --------------------------------------------------

_TASK = """\
task: plexrl_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: What is {{{{a}}}} + {{{{b}}}}? A:"
doc_to_target: " {{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "Q:"]
  max_gen_toks: 8
  temperature: 0
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def _lm_eval() -> Path:
    """The side install; skipped without it, except in CI, where it must be there."""
    if (LM_EVAL / ".plexrl-stamp").is_file():
        return LM_EVAL
    reason = f"{LM_EVAL} is not installed; run scripts/eval_client.sh"
    if os.environ.get("CI") == "true":
        pytest.fail(reason + " (CI must run it before pytest)")
    pytest.skip(reason)


def _run_lm_eval(
    served: Served,
    tmp_path: Path,
    task: str,
    yaml: str,
    docs: list[dict[str, Any]],
    args: list[str],
) -> dict[str, Any]:
    """lm-eval's `local-completions` on one task over `docs`; what lm_eval_run prints."""
    side = _lm_eval()
    data = tmp_path / f"{task}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{task}.yaml").write_text(yaml.format(data=data))
    model_args = ",".join(
        [
            f"model={BASE}",
            f"base_url={served.oai_url}/completions",
            *args,
            "num_concurrent=2",
            "max_retries=1",
        ]
    )
    cmd = [sys.executable, str(ROOT / "tests" / "lm_eval_run.py"), str(tasks), task, model_args]
    env = {
        **os.environ,
        "PYTHONPATH": str(side),
        "OPENAI_API_KEY": KEY,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
    }
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    answered: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(answered["samples"]) == len(docs)
    return answered


def test_lm_eval_harness_runs_a_local_task_through_completions(
    served: Served, tmp_path: Path
) -> None:
    docs = [{"a": a, "b": b, "answer": str(a + b)} for a, b in ((1, 2), (12, 7), (30, 4), (5, 5))]
    untokenized = ["tokenizer_backend=None", "tokenized_requests=False"]
    answered = _run_lm_eval(served, tmp_path, "plexrl_sums", _TASK, docs, untokenized)
    assert 0.0 <= answered["metrics"]["exact_match,none"] <= 1.0
    # Every answer is what the endpoint says greedy decoding gives for that prompt.
    client = served.client()
    for sample in answered["samples"]:
        expected = client.completions.create(
            model=BASE,
            prompt=sample["arguments"][0],
            max_tokens=8,
            temperature=0,
            stop=["\n", "Q:"],
        )
        assert sample["resps"][0] == expected.choices[0].text


_CHOICE_TASK = """\
task: plexrl_pick
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: What is {{{{a}}}} + {{{{b}}}}? A:"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def test_lm_eval_harness_scores_a_multiple_choice_task_with_echoed_logprobs(
    served: Served, tmp_path: Path
) -> None:
    docs = [
        {"a": a, "b": b, "choices": [str(a + b), str(a + b + 1), str(a * b)], "label": 0}
        for a, b in ((1, 2), (12, 7), (3, 4), (5, 6))
    ]
    tokenizer = served.registry / "tiny"
    # Loglikelihood needs lm-eval's own tokenizer, to know where the continuation starts.
    tokenized = [
        "tokenizer_backend=huggingface",
        f"tokenizer={tokenizer}",
        "tokenized_requests=True",
    ]
    answered = _run_lm_eval(served, tmp_path, "plexrl_pick", _CHOICE_TASK, docs, tokenized)
    # Each (context, continuation) scored again from the endpoint's own echoed logprobs.
    client = served.client()
    tok = AutoTokenizer.from_pretrained(tokenizer)
    right = []
    for sample in answered["samples"]:
        mine = []
        for (context, continuation), (theirs, their_greedy) in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            start = len(tok.encode(context, add_special_tokens=False))
            whole = tok.encode(context + continuation, add_special_tokens=False)
            out = client.completions.create(
                model=BASE, prompt=whole, max_tokens=0, echo=True, logprobs=1
            )
            lp = out.choices[0].logprobs
            assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs
            values = [v for v in lp.token_logprobs[start:] if v is not None]
            tops = lp.top_logprobs[start:]
            greedy = all(v == max(t.values()) for v, t in zip(values, tops, strict=True))
            assert abs(sum(values) - theirs) <= LOGPROB_TOL * len(values)
            assert greedy == their_greedy
            mine.append(sum(values))
        right.append(float(max(range(len(mine)), key=mine.__getitem__) == sample["target"]))
    assert answered["metrics"]["acc,none"] == pytest.approx(sum(right) / len(right))
