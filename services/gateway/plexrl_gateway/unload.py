"""Unloading a training model: its state leaves the workers; its checkpoints stay."""

from __future__ import annotations

import msgspec

from plexrl.messages import Function, UnloadInput
from plexrl.stores import JobRecord
from plexrl_gateway.registry import Registry
from plexrl_gateway.render import ResponseKind
from plexrl_gateway.submitter import Call, Submission, Submitter, ready


async def unload_model(job: JobRecord, jobs: Registry, submit: Submitter) -> str:
    """Publish UNLOAD after every call already published for the model; returns its
    request id. The record is marked at once, so later calls get a 404."""
    call = Call(Function.UNLOAD, UnloadInput(), ResponseKind.UNLOAD_MODEL)
    request_id = await submit.submit(Submission(job.job_id, job.tenant), ready(call))
    await jobs.put_job(msgspec.structs.replace(job, unloaded=True))
    return request_id
