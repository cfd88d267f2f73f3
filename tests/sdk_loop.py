"""One end-to-end Tinker loop, run by whichever `tinker` SDK is first on sys.path.

tests/test_sdk_versions.py runs it in a subprocess with PYTHONPATH at a side install
(scripts/sdk_matrix.sh), so each SDK version drives the same calls:

    python tests/sdk_loop.py BASE_URL API_KEY MODEL TOKENIZER_DIR [--more]

It prints one JSON line: the SDK version it ran and what came back. `--more` (the sweep
over every minor, bench/sdk_minors.py; not CI, whose time is short) also calls what the
loop leaves out: server capabilities, get_info, forward, save_state and load_state, a
training client from the saved state, a named sampler save read by a new sampling
client, and compute_logprobs.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from typing import Any


def resolved(client: Any) -> Any:
    """SDKs since the 0.3x return a future that also stands in for the client (deprecated,
    a subclass of it); older ones return the client itself."""
    result = getattr(client, "result", None)
    return result() if callable(result) else client


def main(
    base_url: str, api_key: str, model: str, tokenizer_dir: str, more: bool = False
) -> dict[str, object]:
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokens = tok.encode("12+7=19", add_special_tokens=False)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(
                data=tokens[1:], dtype="int64", shape=[len(tokens) - 1]
            ),
            "weights": types.TensorData(
                data=[1.0] * (len(tokens) - 1), dtype="float32", shape=[len(tokens) - 1]
            ),
        },
    )
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    client = resolved(service.create_lora_training_client(base_model=model, rank=4, seed=1))
    losses = []
    for _ in range(2):
        out = client.forward_backward([datum], "cross_entropy").result()
        logprobs = out.loss_fn_outputs[0]["logprobs"].tolist()
        assert len(logprobs) == len(tokens) - 1, logprobs
        losses.append(out.metrics["loss:sum"])
        client.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    sampler = resolved(client.save_weights_and_get_sampling_client())
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    prompt = types.ModelInput.from_ints(tokens[:4])
    result = sampler.sample(prompt=prompt, num_samples=2, sampling_params=params).result()
    sampled = [list(seq.tokens) for seq in result.sequences]
    assert len(sampled) == 2 and all(1 <= len(s) <= 4 for s in sampled), sampled
    ran: dict[str, object] = {
        "sdk": version("tinker"),
        "file": tinker.__file__,
        "losses": losses,
        "sampled": sampled,
    }
    if more:
        ran.update(more_calls(service, client, datum, prompt, params))
    return ran


def more_calls(service: Any, client: Any, datum: Any, prompt: Any, params: Any) -> dict[str, Any]:
    """The calls the short loop leaves out, each checked against what it should give."""
    models = service.get_server_capabilities().supported_models
    assert models, "the server names no model"
    info = client.get_info()
    forward = client.forward([datum], "cross_entropy").result()
    logprobs = [round(v, 5) for v in forward.loss_fn_outputs[0]["logprobs"].tolist()]
    state = client.save_state("more-state").result().path
    client.load_state(state).result()
    again = client.forward([datum], "cross_entropy").result()
    assert [round(v, 5) for v in again.loss_fn_outputs[0]["logprobs"].tolist()] == logprobs
    restored = resolved(service.create_training_client_from_state(state))
    from_state = restored.forward([datum], "cross_entropy").result()
    assert [round(v, 5) for v in from_state.loss_fn_outputs[0]["logprobs"].tolist()] == logprobs
    weights = client.save_weights_for_sampler("more-sampler").result().path
    sampler = resolved(service.create_sampling_client(model_path=weights))
    named = sampler.sample(prompt=prompt, num_samples=1, sampling_params=params).result()
    prompt_logprobs = sampler.compute_logprobs(prompt).result()
    assert len(prompt_logprobs) == prompt.length and prompt_logprobs[0] is None, prompt_logprobs
    return {
        "model_id": str(info.model_id),
        "forward": logprobs,
        "state": state,
        "sampler_weights": weights,
        "named_sample": list(named.sequences[0].tokens),
        "prompt_logprobs": [None if v is None else round(v, 5) for v in prompt_logprobs],
    }


if __name__ == "__main__":
    base_url, api_key, model, tokenizer_dir = sys.argv[1:5]
    more = "--more" in sys.argv[5:]
    print(json.dumps(main(base_url, api_key, model, tokenizer_dir, more)), flush=True)
