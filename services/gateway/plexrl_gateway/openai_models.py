"""What an OpenAI `model` names, and the sampling job its calls run under.

`model` is a served base model (a canonical name or an alias), a runnable tinker path
(`tinker://<run>/sampler_weights/<name>` or `.../weights/<name>`), or `<base>;<path>`
(the path, checked to be over that base). Each (tenant, model) gets one sampling job,
made on first use with a stable id, exactly as `create_sampling_session` makes one: over
a checkpoint of a live training model its calls run under that model's job id (on its
home worker, beside its training), otherwise as a job of their own. So the scheduler
places, multiplexes and accounts them like any `sample` call of the tenant.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from plexrl.messages import JobSpec
from plexrl.models import BaseModelInfo
from plexrl.stores import JobKind, JobRecord
from plexrl_gateway.catalog import ModelCatalog
from plexrl_gateway.errors import ApiError
from plexrl_gateway.openai_errors import OpenAIError, invalid
from plexrl_gateway.registry import Registry, new_job
from plexrl_gateway.translate import TINKER_SCHEME, parse_runnable_path

SESSION_PREFIX = "oai-"
"""Sampling jobs of the OpenAI API belong to the pseudo-session `oai-<tenant digest>`."""


@dataclass(frozen=True)
class Target:
    """A resolved `model`: the weights to sample and the job the calls run under."""

    name: str
    """The model as the client named it (answered back in `model`)."""
    info: BaseModelInfo
    """The base model (its directory holds the tokenizer and chat template)."""
    weights_path: str | None
    """The checkpoint sampled; None samples the base weights."""
    job: JobRecord
    """The sampling job (its spec travels with a call that has no live owner)."""
    owner: str | None
    """A live training model whose checkpoint this is: the calls run under its job id."""

    @property
    def job_id(self) -> str:
        return self.owner or self.job.job_id


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _not_found(model: str, message: str) -> OpenAIError:
    return OpenAIError(404, message, param="model", code="model_not_found")


async def _base(catalog: ModelCatalog, name: str, model: str) -> BaseModelInfo:
    names = await catalog.names()
    if name not in names:
        served = ", ".join(names) or "none"
        raise _not_found(model, f"the model {name!r} does not exist; served models: {served}")
    return await catalog.info(name)


async def resolve(
    model: str, tenant: str, jobs: Registry, catalog: ModelCatalog, *, make_job: bool = True
) -> Target:
    """The model a request names, with its sampling job (made when it is new; when
    `make_job` is false, a new job is described but not stored)."""
    base_name, _, path = model.partition(";") if ";" in model else ("", "", model)
    if not path.startswith(TINKER_SCHEME):
        if base_name:
            raise invalid(
                f"model {model!r}: after ';' comes a tinker:// path, like "
                "<base>;tinker://<run>/sampler_weights/<name>",
                "model",
            )
        info = await _base(catalog, model, model)
        base_model, weights_path, owner_of = info.name, None, None
    else:
        try:
            weights_path = str(parse_runnable_path(path))
        except ApiError as exc:
            raise invalid(exc.message, "model") from None
        ckpt = await jobs.find_checkpoint(tenant, weights_path)
        if ckpt is None:
            raise _not_found(model, f"the model {model!r} does not exist: no checkpoint at {path}")
        info = await _base(catalog, ckpt.base_model, model)
        if base_name and (await _base(catalog, base_name, model)).name != info.name:
            raise invalid(
                f"model {model!r}: the checkpoint is over {ckpt.base_model}, not {base_name}",
                "model",
            )
        base_model, owner_of = ckpt.base_model, ckpt.job_id
    job_id = f"{SESSION_PREFIX}{_digest(tenant)}:sample:{_digest(weights_path or base_model)}"
    job = await jobs.find_job(tenant, job_id)
    if job is None:
        owner = await jobs.live_owner(tenant, owner_of) if owner_of else None
        job = new_job(
            JobKind.SAMPLING,
            job_id,
            tenant,
            f"{SESSION_PREFIX}{_digest(tenant)}",
            JobSpec(base_model=base_model),
            sampler_path=weights_path,
            owner_job=owner,
            metadata={"openai_model": model[:200]},
        )
        if make_job:
            await jobs.put_job(job)
    # The owner may have been unloaded since: then the calls run as a job of their own.
    owner = await jobs.live_owner(tenant, job.owner_job) if job.owner_job else None
    return Target(model, info, weights_path, job, owner)
