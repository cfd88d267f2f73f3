"""The OpenAI-compatible API through the official `openai` client, and through an
evaluation client PlexRL did not write (EleutherAI's lm-evaluation-harness, installed
beside .venv by scripts/eval_client.sh), against all four services on the real Kafka and
Redis, over a tiny model built here.

One cluster for the module. Its registry holds the tiny Qwen3 (with an alias and its
ChatML template) and a copy whose tokenizer has no chat template.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import openai
import pytest
import tinker
from tinker import types
from transformers import AutoTokenizer

from plexrl.cluster import ClusterConfig, LocalCluster
from plexrl.models import PLEXRL_JSON, init_tiny

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


def _without_chat_template(src: Path, dst: Path, name: str) -> None:
    shutil.copytree(src, dst)
    (dst / PLEXRL_JSON).write_text(json.dumps({"name": name}))
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    config = dst / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data.pop("chat_template", None)
    config.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def served(infra: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("openai-models")
    init_tiny(root / "tiny", aliases=[ALIAS])
    _without_chat_template(root / "tiny", root / "nochat", NO_CHAT)
    assert AutoTokenizer.from_pretrained(root / "nochat").chat_template is None
    config = ClusterConfig.on_free_ports(
        root,
        tmp_path_factory.mktemp("openai-cluster"),
        "oai",
        api_keys=f"{KEY}={TENANT}",
        worker_threads=1,
    )
    with LocalCluster(config):
        yield Served(config, root)


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
            model=BASE, messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3
        )
    assert top.value.param == "top_logprobs"
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


def test_lm_eval_harness_runs_a_local_task_through_completions(
    served: Served, tmp_path: Path
) -> None:
    side = _lm_eval()
    docs = [{"a": a, "b": b, "answer": str(a + b)} for a, b in ((1, 2), (12, 7), (30, 4), (5, 5))]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "plexrl_sums.yaml").write_text(_TASK.format(data=data))
    model_args = ",".join(
        [
            f"model={BASE}",
            f"base_url={served.oai_url}/completions",
            "tokenizer_backend=None",
            "tokenized_requests=False",
            "num_concurrent=2",
            "max_retries=1",
        ]
    )
    cmd = [sys.executable, str(ROOT / "tests" / "lm_eval_run.py"), str(tasks), "plexrl_sums"]
    env = {
        **os.environ,
        "PYTHONPATH": str(side),
        "OPENAI_API_KEY": KEY,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
    }
    run = subprocess.run([*cmd, model_args], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    answered = json.loads(run.stdout.strip().splitlines()[-1])
    assert 0.0 <= answered["metrics"]["exact_match,none"] <= 1.0
    assert len(answered["samples"]) == len(docs)
    # Every answer is what the endpoint says greedy decoding gives for that prompt.
    client = served.client()
    for sample in answered["samples"]:
        expected = client.completions.create(
            model=BASE, prompt=sample["prompt"], max_tokens=8, temperature=0, stop=["\n", "Q:"]
        )
        assert sample["response"] == expected.choices[0].text
