"""Every loss in the Tinker SDK's LossFnType: its value on a hand-computed batch, its
gradient (autograd's gradcheck in float64 where the loss has no stop-gradient, a closed
form everywhere), the gateway accepting it, and the SDK running it end to end."""

from __future__ import annotations

import math
import os
import typing
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import tinker
import torch
from tinker import types
from tinker.proto import request_conv

from plexrl.losses import LOSS_CONFIG_DEFAULTS, LOSS_INPUTS, loss_config
from plexrl.messages import Datum, ForwardBackwardInput, JobSpec, LoraSpec, LossFn, TensorArray
from plexrl.models import ModelRegistry, init_tiny
from plexrl_gateway.errors import ApiError
from plexrl_gateway.proto import tinker_public_pb2 as pb
from plexrl_gateway.translate import ModelLimits, forward_backward_input
from plexrl_tools.cluster import ClusterConfig
from plexrl_worker.engine import EngineConfig, TorchEngine
from plexrl_worker.engine.arrays import to_tensor
from plexrl_worker.engine.losses import elementwise_loss

# The tiny batch every value below is computed on by hand: one datum of three tokens.
# Sampler logprobs are set so the ratios p/q are exactly 0.5, 1 and 3.
LP = [-1.0, -2.0, -0.5]
RATIOS = [0.5, 1.0, 3.0]
ADV = [1.0, -2.0, 0.5]
LN2, LN3 = math.log(2.0), math.log(3.0)


def batch(**extra: list[float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logprobs = torch.tensor([LP], dtype=torch.float64, requires_grad=True)
    sampler = [lp - math.log(r) for lp, r in zip(LP, RATIOS, strict=True)]
    inputs = {
        "logprobs": torch.tensor([sampler], dtype=torch.float64),
        "advantages": torch.tensor([ADV], dtype=torch.float64),
        "weights": torch.ones(1, 3, dtype=torch.float64),
        "sequence_ratio_mask": torch.ones(1, 3, dtype=torch.float64),
    }
    inputs.update({k: torch.tensor([v], dtype=torch.float64) for k, v in extra.items()})
    return logprobs, inputs


def terms(loss_fn: LossFn, config: dict[str, float] | None = None, **extra: list[float]) -> Any:
    logprobs, inputs = batch(**extra)
    out = elementwise_loss(loss_fn, logprobs, inputs, loss_config(loss_fn, config))
    (grad,) = torch.autograd.grad(out.sum(), logprobs)
    return out.detach()[0].tolist(), grad[0].tolist()


# Per-token terms, worked out on paper from the formulas in docs/losses.md.
GSPO_S = 1.5 ** (1 / 3)  # geometric mean of the ratios 0.5, 1, 3
HAND_VALUES: list[tuple[LossFn, dict[str, float] | None, dict[str, list[float]], list[float]]] = [
    # -w * lp with weights 1, 0, 2
    (LossFn.CROSS_ENTROPY, None, {"weights": [1.0, 0.0, 2.0]}, [1.0, 0.0, 1.0]),
    # -r * A
    (LossFn.IMPORTANCE_SAMPLING, None, {}, [-0.5, 2.0, -1.5]),
    # -min(r A, clip(r, 0.8, 1.2) A): 0.5 < 0.8 keeps 0.5; 3 is cut to 1.2 * 0.5
    (LossFn.PPO, None, {}, [-0.5, 2.0, -0.6]),
    # -sg(clip(r, 0, 4)) * lp * A
    (LossFn.CISPO, None, {}, [0.5, -4.0, 0.75]),
    # cap 2: the third token's coefficient is 2 instead of 3
    (LossFn.CISPO, {"clip_high_threshold": 2.0}, {}, [0.5, -4.0, 0.5]),
    # -(lp A - 0.05/2 (log r)^2)
    (LossFn.DRO, None, {}, [1.0 + 0.025 * LN2**2, -4.0, 0.25 + 0.025 * LN3**2]),
    # -min(s A, clip(s, 0.9997, 1.0004) A) with s = 1.5^(1/3) = 1.1447 on every token
    (LossFn.GSPO, None, {}, [-1.0004, 2.0 * GSPO_S, -0.5 * 1.0004]),
    # a mask leaving the third token out: s = sqrt(0.5); wide clips keep s itself
    (
        LossFn.GSPO,
        {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0},
        {"sequence_ratio_mask": [1.0, 1.0, 0.0]},
        [-math.sqrt(0.5), 2.0 * math.sqrt(0.5), -0.5 * math.sqrt(0.5)],
    ),
    # -sg(min(r, 2)) * lp * A
    (LossFn.STABLE_REINFORCE, None, {}, [0.5, -4.0, 0.5]),
    # plus 0.1 * (r - 1 - log r)
    (
        LossFn.STABLE_REINFORCE,
        {"kl_coeff": 0.1},
        {},
        [0.5 + 0.1 * (LN2 - 0.5), -4.0, 0.5 + 0.1 * (2.0 - LN3)],
    ),
]


@pytest.mark.parametrize(("loss_fn", "config", "extra", "want"), HAND_VALUES)
def test_loss_values_match_the_hand_computation(
    loss_fn: LossFn,
    config: dict[str, float] | None,
    extra: dict[str, list[float]],
    want: list[float],
) -> None:
    got, _ = terms(loss_fn, config, **extra)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


def closed_form_gradient(loss_fn: LossFn, config: dict[str, float] | None = None) -> list[float]:
    """d(sum of terms)/d(logprobs), derived by hand, token by token (weights all 1)."""
    cfg = loss_config(loss_fn, config)
    grads = []
    for lp, r, a in zip(LP, RATIOS, ADV, strict=True):
        if loss_fn == LossFn.CROSS_ENTROPY:
            g = -1.0
        elif loss_fn == LossFn.IMPORTANCE_SAMPLING:
            g = -r * a
        elif loss_fn == LossFn.PPO:
            clipped = min(max(r, cfg["clip_low_threshold"]), cfg["clip_high_threshold"])
            g = -r * a if r * a <= clipped * a else 0.0  # the clipped branch is constant
        elif loss_fn == LossFn.CISPO:
            g = -min(max(r, cfg["clip_low_threshold"]), cfg["clip_high_threshold"]) * a
        elif loss_fn == LossFn.DRO:
            g = -a + cfg["beta"] * math.log(r)
        elif loss_fn == LossFn.GSPO:
            s = GSPO_S
            clipped = min(max(s, cfg["clip_low_threshold"]), cfg["clip_high_threshold"])
            g = -s * a if s * a <= clipped * a else 0.0
        elif loss_fn == LossFn.STABLE_REINFORCE:
            g = -min(r, cfg["clip_high_threshold"]) * a + cfg["kl_coeff"] * (r - 1.0)
        else:
            raise AssertionError(loss_fn)
        del lp
        grads.append(g)
    return grads


GRADIENT_CASES: list[tuple[LossFn, dict[str, float] | None]] = [
    (LossFn.CROSS_ENTROPY, None),
    (LossFn.IMPORTANCE_SAMPLING, None),
    (LossFn.PPO, None),
    (LossFn.CISPO, None),
    (LossFn.CISPO, {"clip_low_threshold": 0.7, "clip_high_threshold": 2.0}),
    (LossFn.DRO, {"beta": 0.3}),
    (LossFn.GSPO, None),
    (LossFn.GSPO, {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}),
    (LossFn.STABLE_REINFORCE, None),
    (LossFn.STABLE_REINFORCE, {"clip_high_threshold": 5.0, "kl_coeff": 0.2}),
]


@pytest.mark.parametrize(("loss_fn", "config"), GRADIENT_CASES)
def test_gradients_match_the_closed_form(loss_fn: LossFn, config: dict[str, float] | None) -> None:
    _, grad = terms(loss_fn, config)
    assert grad == pytest.approx(closed_form_gradient(loss_fn, config), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(
    "loss_fn", [LossFn.CROSS_ENTROPY, LossFn.IMPORTANCE_SAMPLING, LossFn.PPO, LossFn.DRO]
)
def test_gradients_of_losses_without_stop_gradient_pass_gradcheck(loss_fn: LossFn) -> None:
    # Finite differences only agree with autograd where the value is the objective
    # itself; CISPO, GSPO and stable_reinforce detach on purpose and are checked above.
    # No ratio sits on a clip edge (0.8, 1.2), so PPO is differentiable at this point.
    logprobs, inputs = batch()
    config = loss_config(loss_fn, None)
    assert torch.autograd.gradcheck(
        lambda lp: elementwise_loss(loss_fn, lp, inputs, config).sum(), (logprobs,)
    )


def test_every_sdk_loss_is_in_the_contract() -> None:
    sdk = set(typing.get_args(types.LossFnType)) - {"custom"}
    assert sdk == {f.value for f in LossFn} == {f.value for f in LOSS_INPUTS}
    assert set(LOSS_CONFIG_DEFAULTS) == set(LossFn)


@pytest.mark.parametrize(
    ("loss_fn", "config", "message"),
    [
        (LossFn.CISPO, {"clip_low_threshold": 3.0, "clip_high_threshold": 2.0}, "0 <= clip_low"),
        (LossFn.DRO, {"beta": -1.0}, "beta is -1.0"),
        (LossFn.DRO, {"clip_low_threshold": 0.5}, "it takes beta"),
        (LossFn.STABLE_REINFORCE, {"clip_high_threshold": 0.0}, "cap must be > 0"),
        (LossFn.STABLE_REINFORCE, {"kl_coeff": -0.1}, "kl_coeff is -0.1"),
        (LossFn.GSPO, {"beta": 0.1}, "it takes clip_low_threshold, clip_high_threshold"),
    ],
)
def test_bad_configs_say_what_to_change(
    loss_fn: LossFn, config: dict[str, float], message: str
) -> None:
    with pytest.raises(ValueError) as caught:
        loss_config(loss_fn, config)
    assert message in str(caught.value)


# The gateway ----------------------------------------------------------------------------

LIMITS = ModelLimits(vocab_size=100, max_positions=32)


def fb_proto(data: list[types.Datum], loss_fn: str, **kw: Any) -> pb.ForwardBackwardRequest:
    """The SDK's own encoding of a forward_backward call, read by the gateway's module."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, **kw),  # type: ignore[arg-type]
        model_id="s:train:0",
        seq_id=1,
    )
    ours = pb.ForwardBackwardRequest()
    ours.ParseFromString(
        request_conv.forward_backward_request_to_proto(request).SerializeToString()
    )
    return ours


def rl_datum(**extra: list[float]) -> types.Datum:
    given: dict[str, list[float]] = {
        "logprobs": [-1.0, -1.0, -1.0],
        "advantages": [1.0, 1.0, -1.0],
        **extra,
    }
    inputs = {k: types.TensorData(data=v, dtype="float32") for k, v in given.items()}
    inputs["target_tokens"] = types.TensorData(data=[2, 3, 4], dtype="int64")
    return types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs=inputs)


@pytest.mark.parametrize(
    ("loss_fn", "config"),
    [
        ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
        ("dro", {"beta": 0.05}),
        ("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
        ("stable_reinforce", {"kl_coeff": 0.01}),
    ],
)
def test_the_gateway_accepts_the_new_losses_with_their_config(
    loss_fn: str, config: dict[str, float]
) -> None:
    inp, _ = forward_backward_input(fb_proto([rl_datum()], loss_fn, loss_fn_config=config), LIMITS)
    assert inp.loss_fn == LossFn(loss_fn)
    assert inp.loss_fn_config == pytest.approx(config)


def test_the_gateway_takes_gspo_masks_and_stable_reinforce_provenance() -> None:
    masked = rl_datum(sequence_ratio_mask=[0.0, 1.0, 1.0])
    inp, _ = forward_backward_input(fb_proto([masked], "gspo"), LIMITS)
    assert to_tensor(inp.data[0].loss_fn_inputs["sequence_ratio_mask"]).tolist() == [0, 1, 1]
    # The cookbook names the sampled sequence behind every token, as Tinker requires for
    # stable_reinforce; PlexRL reads the sampler's logprobs from the datum instead.
    spans = rl_datum().with_provenance(
        model_input=[types.SampledProvenanceSpan(sequence_id="s:seq:0:0", length=3)],
        loss_fn_inputs=[types.SampledProvenanceSpan(sequence_id="s:seq:0:0", length=3)],
    )
    inp, _ = forward_backward_input(fb_proto([spans], "stable_reinforce"), LIMITS)
    assert inp.loss_fn == LossFn.STABLE_REINFORCE
    with pytest.raises(ApiError, match="mean nothing to dro; it takes beta"):
        forward_backward_input(
            fb_proto([rl_datum()], "dro", loss_fn_config={"kl_coeff": 1.0}), LIMITS
        )


# The engine on a real model ---------------------------------------------------------------

BASE = "plexrl/tiny-qwen3"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TorchEngine:
    root = tmp_path_factory.mktemp("loss-models")
    init_tiny(root / "tiny")
    return TorchEngine(ModelRegistry(root), EngineConfig())


def engine_datum(seq: list[int], advantage: float) -> Datum:
    n = len(seq) - 1
    return Datum(
        tokens=seq[:-1],
        loss_fn_inputs={
            "target_tokens": TensorArray.from_list(seq[1:], "int64"),
            "logprobs": TensorArray.from_list([-3.0] * n, "float32"),
            "advantages": TensorArray.from_list([advantage] * n, "float32"),
        },
    )


@pytest.mark.parametrize("loss_fn", [LossFn.GSPO, LossFn.CISPO, LossFn.STABLE_REINFORCE])
def test_a_datums_terms_do_not_depend_on_its_batch_neighbours(
    engine: TorchEngine, loss_fn: LossFn
) -> None:
    # GSPO averages over a row: padding a short row next to a long one must not enter it.
    job = f"job-{loss_fn}"
    engine.create(job, JobSpec(base_model=BASE, lora=LoraSpec(rank=4), seed=1))
    short, long = engine_datum([5, 6, 7, 8], 1.0), engine_datum(list(range(20, 34)), -1.0)

    def run(data: list[Datum]) -> list[list[float]]:
        out = engine.forward_backward(
            job, ForwardBackwardInput(data=data, loss_fn=loss_fn, backward=False)
        )
        return [to_tensor(o["elementwise_loss"]).tolist() for o in out.loss_fn_outputs]

    together = run([long, short])
    assert together[1] == pytest.approx(run([short])[0], rel=1e-5, abs=1e-6)
    assert together[0] == pytest.approx(run([long])[0], rel=1e-5, abs=1e-6)


# The unmodified SDK against all four services ------------------------------------------

KEY = "tml-losses"


@pytest.fixture(scope="module")
def service(shared_cluster: ClusterConfig) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=shared_cluster.gateway_url, api_key=KEY)


def sdk_datum(tokens: list[int], sampler_lp: list[float], advantages: list[float]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
            "logprobs": types.TensorData(data=sampler_lp, dtype="float32"),
            "advantages": types.TensorData(data=advantages, dtype="float32"),
        },
    )


@pytest.mark.integration
def test_sdk_runs_every_loss_and_forward_backward_custom(service: tinker.ServiceClient) -> None:
    tokens = [5, 6, 7, 8, 9, 10]
    ce = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64")},
    )
    twin_a = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    twin_b = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    lp = torch.tensor(
        twin_a.forward([ce], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    )

    # Each new loss, its value checked against the formula on the returned logprobs.
    sampler = (lp - torch.log(torch.tensor([0.5, 1.0, 3.0, 1.0, 2.0]))).tolist()
    advantages = [1.0, -2.0, 0.5, 1.0, -1.0]
    rl = sdk_datum(tokens, sampler, advantages)
    for loss_fn in ("cispo", "dro", "gspo", "stable_reinforce"):
        out = twin_a.forward([rl], loss_fn).result()
        got_lp = torch.tensor(out.loss_fn_outputs[0]["logprobs"].tolist(), dtype=torch.float64)
        inputs = {
            "logprobs": torch.tensor([sampler], dtype=torch.float64),
            "advantages": torch.tensor([advantages], dtype=torch.float64),
            "weights": torch.ones(1, 5, dtype=torch.float64),
            "sequence_ratio_mask": torch.ones(1, 5, dtype=torch.float64),
        }
        fn = LossFn(loss_fn)
        want = elementwise_loss(fn, got_lp[None], inputs, loss_config(fn, None)).sum()
        assert out.metrics["loss:sum"] == pytest.approx(float(want), rel=1e-4, abs=1e-4), loss_fn

    # forward_backward_custom: the SDK runs forward, differentiates the callable on the
    # client, and sends -dC/dlogprobs as cross_entropy weights. A custom loss equal to
    # cross_entropy must train exactly like the built-in one (CPU engines are deterministic).
    def custom_ce(data: list[types.Datum], logprobs: list[torch.Tensor]) -> Any:
        loss = torch.stack([(-lp).sum() for lp in logprobs]).sum()
        return loss, {"custom:sum": float(loss.detach())}

    custom = twin_a.forward_backward_custom([ce], custom_ce).result()
    builtin = twin_b.forward_backward([ce], "cross_entropy").result()
    assert custom.metrics["loss:sum"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-5)
    assert custom.metrics["custom:sum"] == pytest.approx(-float(lp.sum()), rel=1e-5)
    adam = types.AdamParams(learning_rate=1e-2)
    twin_a.optim_step(adam).result()
    twin_b.optim_step(adam).result()
    after_a = twin_a.forward([ce], "cross_entropy").result().metrics["loss:sum"]
    after_b = twin_b.forward([ce], "cross_entropy").result().metrics["loss:sum"]
    assert after_a == pytest.approx(after_b, rel=1e-5)
    assert after_a < float(-lp.sum())  # the step lowered the loss it was taken on
