"""Tinker API: sampling sessions and sampling.

A sampling session over a sampler checkpoint of a live training model of the same
tenant samples under that model's job id, so it runs on the model's home worker, in
Kafka order with its training calls. A session over base weights (or over a checkpoint
whose model is gone) is a job of its own.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from plexrl.limits import InputError, check_num_samples
from plexrl.messages import Function, JobSpec
from plexrl.stores import JobKind
from plexrl_gateway.deps import Catalog, Jobs, Submit, Tenant
from plexrl_gateway.errors import bad_request
from plexrl_gateway.registry import new_job
from plexrl_gateway.render import CTX_LAST_N, ResponseKind
from plexrl_gateway.schemas import CreateSamplingSessionBody, SampleBody
from plexrl_gateway.submitter import Call, Submission, ready
from plexrl_gateway.translate import (
    check_seq,
    parse_runnable_path,
    sample_input,
    sampling_session_id,
)

router = APIRouter(prefix="/api/v1")


@router.post("/create_sampling_session")
async def create_sampling_session(
    body: CreateSamplingSessionBody, tenant: Tenant, jobs: Jobs, catalog: Catalog
) -> dict[str, Any]:
    await jobs.session(tenant, body.session_id)
    seq = check_seq("sampling_session_seq_id", body.sampling_session_seq_id)
    session_id = sampling_session_id(body.session_id, seq)
    if await jobs.find_job(tenant, session_id) is None:
        if body.model_path is not None:
            path = str(parse_runnable_path(body.model_path))
            ckpt = await jobs.checkpoint(tenant, path)
            base_model, owner = ckpt.base_model, await jobs.live_owner(tenant, ckpt.job_id)
        elif body.base_model is not None:
            await catalog.info(body.base_model)
            base_model, path, owner = body.base_model, None, None
        else:
            raise bad_request("create_sampling_session needs model_path or base_model")
        job = new_job(
            JobKind.SAMPLING,
            session_id,
            tenant,
            body.session_id,
            JobSpec(base_model=base_model),
            sampler_path=path,
            owner_job=owner,
        )
        await jobs.put_job(job)
    return {"type": "create_sampling_session", "sampling_session_id": session_id}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, tenant: Tenant, jobs: Jobs) -> dict[str, Any]:
    job = await jobs.sampling_session(tenant, sampler_id)
    out: dict[str, Any] = {"sampler_id": job.job_id, "base_model": job.spec.base_model}
    if job.sampler_path is not None:
        out["model_path"] = job.sampler_path
    return out


@router.post("/asample")
async def asample(
    body: SampleBody, tenant: Tenant, jobs: Jobs, catalog: Catalog, submit: Submit
) -> dict[str, Any]:
    if body.sampling_session_id is None:
        raise bad_request(
            "asample needs sampling_session_id; open one with create_sampling_session"
        )
    session = await jobs.sampling_session(tenant, body.sampling_session_id)
    seq = check_seq("seq_id", body.seq_id)
    try:
        check_num_samples(body.num_samples)  # before a list of that many ids is made
    except InputError as exc:
        raise bad_request(str(exc)) from None
    sequence_ids = [f"{session.job_id}:seq:{seq}:{i}" for i in range(body.num_samples)]
    key = f"sample:{session.job_id}:{seq}"
    if earlier := await submit.existing(key):
        return {"request_id": earlier, "sample_sequence_ids": sequence_ids}
    limits = await catalog.limits(session.spec.base_model)
    inp, work = sample_input(body, limits, session.sampler_path)
    owner = await jobs.live_owner(tenant, session.owner_job) if session.owner_job else None
    context = {}
    if body.prompt_logprobs_last_n is not None:
        context[CTX_LAST_N] = str(body.prompt_logprobs_last_n)
    call = Call(
        Function.SAMPLE,
        inp,
        ResponseKind.SAMPLE,
        context,
        # A job of its own carries its spec, so the scheduler can admit it on first sight.
        spec=None if owner else session.spec,
        work=work,
    )
    sub = Submission(owner or session.job_id, tenant, sequenced=False, retry_key=key)
    return {
        "request_id": await submit.submit(sub, ready(call)),
        "sample_sequence_ids": sequence_ids,
    }
