"""Tinker API: training models (create, info, forward/backward, optimizer, save, load, unload).

Every call that runs on a worker answers at once with a future (`request_id`); the
client polls /retrieve_future. A model's calls are published in seq_id order, and a
re-sent call (same model and seq_id) gets its first future back.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Request

from plexrl import age_encryption, hf_cache
from plexrl.messages import (
    CreateInput,
    ExportOptions,
    Function,
    JobSpec,
    LoadInput,
    LoraSpec,
    OptimStepInput,
    SaveInput,
    SaveKind,
)
from plexrl.models import BaseModelInfo
from plexrl.stores import CheckpointRecord, JobKind, JobRecord
from plexrl.stores.checkpoints import EPHEMERAL_PREFIX
from plexrl_gateway.body_limit import BodyParser, Parser, is_json_media
from plexrl_gateway.codec import PROTOBUF, decode_forward_backward
from plexrl_gateway.codec_json import forward_backward_from_json
from plexrl_gateway.deps import Catalog, Jobs, Placements, Submit, Tenant
from plexrl_gateway.errors import bad_request
from plexrl_gateway.proto import tinker_public_pb2 as pb
from plexrl_gateway.registry import metadata_strings, new_job
from plexrl_gateway.render import CTX_MODEL_ID, CTX_NO_PATH, CTX_SAMPLING_SESSION, ResponseKind
from plexrl_gateway.schemas import (
    CreateModelBody,
    ForwardBackwardBody,
    ForwardBody,
    LoadWeightsBody,
    ModelIdBody,
    OptimStepBody,
    SaveWeightsBody,
    SaveWeightsExternalBody,
    SaveWeightsForSamplerBody,
    struct_request_body,
)
from plexrl_gateway.sdk import ephemeral_save_carries_path, sdk_version
from plexrl_gateway.submitter import Call, CallBuilder, Submission, Submitter
from plexrl_gateway.translate import (
    CheckpointKind,
    TinkerPath,
    adam_params,
    check_seq,
    checkpoint_name,
    forward_backward_input,
    job_spec,
    parse_runnable_path,
    sampling_session_id,
    session_of,
    training_model_id,
)
from plexrl_gateway.unload import unload_model

router = APIRouter(prefix="/api/v1")


def model_retry_key(model_id: str, seq_id: int) -> str:
    return f"model:{model_id}:{seq_id}"


def future_ref(request_id: str, model_id: str) -> dict[str, Any]:
    return {"request_id": request_id, "model_id": model_id}


@router.post("/create_model")
async def create_model(
    body: CreateModelBody,
    tenant: Tenant,
    jobs: Jobs,
    catalog: Catalog,
    placement: Placements,
    submit: Submit,
) -> dict[str, Any]:
    await jobs.session(tenant, body.session_id)
    model_id = training_model_id(body.session_id, check_seq("model_seq_id", body.model_seq_id))

    async def build() -> list[Call]:
        spec = job_spec(body, state_bytes=0)
        info = await catalog.info(body.base_model)
        spec = msgspec.structs.replace(spec, state_bytes=state_bytes(info, spec.lora))
        await placement.check(model_id, spec)  # 400 if no worker group could hold it
        metadata = metadata_strings(body.user_metadata)
        job = new_job(JobKind.TRAINING, model_id, tenant, body.session_id, spec, metadata=metadata)
        await jobs.put_job(job)
        return [Call(Function.CREATE, CreateInput(spec), ResponseKind.CREATE_MODEL, spec=spec)]

    sub = Submission(model_id, tenant, 0, retry_key=model_retry_key(model_id, 0))
    return future_ref(await submit.submit(sub, build), model_id)


@router.post("/get_info")
async def get_info(
    body: ModelIdBody, tenant: Tenant, jobs: Jobs, catalog: Catalog
) -> dict[str, Any]:
    job = await jobs.training_model(tenant, body.model_id)
    info = await catalog.info(job.spec.base_model)
    # The SDK loads `tokenizer_id` with AutoTokenizer on the client's machine. A name
    # registered in the Hugging Face cache (`plexrl model init-tiny`, `plexrl model
    # cache`) resolves there too, offline, where this machine's path may not exist (a
    # gateway in a container); else the path, if it has no ':' (the SDK cuts there).
    path = str(info.path.resolve())
    model_data = {"arch": info.family, "model_name": job.spec.base_model}
    if hf_cache.is_registered(job.spec.base_model):
        model_data["tokenizer_id"] = job.spec.base_model
    elif ":" not in path:
        model_data["tokenizer_id"] = path
    out: dict[str, Any] = {
        "type": "get_info",
        "model_id": job.job_id,
        "model_data": model_data,
        "model_name": job.spec.base_model,
        "is_lora": job.spec.lora is not None,
        "optimizer_config": {"type": "adamw"},
    }
    if job.spec.lora is not None:
        out["lora_rank"] = job.spec.lora.rank
    return out


@router.post("/forward_backward", openapi_extra=struct_request_body(ForwardBackwardBody, PROTOBUF))
async def forward_backward(
    request: Request, parser: Parser, tenant: Tenant, jobs: Jobs, catalog: Catalog, submit: Submit
) -> dict[str, Any]:
    proto = await _forward_backward_request(request, parser, forward_only=False)
    return await _forward_backward(proto, tenant, jobs, catalog, submit)


@router.post("/forward", openapi_extra=struct_request_body(ForwardBody, PROTOBUF))
async def forward(
    request: Request, parser: Parser, tenant: Tenant, jobs: Jobs, catalog: Catalog, submit: Submit
) -> dict[str, Any]:
    """SDKs before protobuf call `forward` here (newer ones set forward_only instead)."""
    proto = await _forward_backward_request(request, parser, forward_only=True)
    return await _forward_backward(proto, tenant, jobs, catalog, submit)


async def _forward_backward_request(
    request: Request, parser: BodyParser, forward_only: bool
) -> pb.ForwardBackwardRequest:
    """The protobuf body newer SDKs send, or the JSON one older SDKs send, as protobuf."""
    if request.headers.get("content-encoding"):
        raise bad_request(
            "compressed forward_backward bodies are not supported (proto_compress_fwdbwd is off)"
        )
    content_type = request.headers.get("content-type", "")
    if PROTOBUF in content_type:
        proto = await parser.parse(await request.body(), decode_forward_backward)
        proto.forward_only = proto.forward_only or forward_only
        return proto
    if is_json_media(content_type):
        caps = parser.limits
        return await parser.parse(
            await request.body(), lambda data: forward_backward_from_json(data, forward_only, caps)
        )
    raise bad_request(
        "forward_backward takes a tinker_public.ForwardBackwardRequest protobuf "
        f"(Content-Type: {PROTOBUF}) or its JSON form (application/json)"
    )


async def _forward_backward(
    proto: pb.ForwardBackwardRequest, tenant: str, jobs: Jobs, catalog: Catalog, submit: Submitter
) -> dict[str, Any]:
    job = await jobs.training_model(tenant, proto.model_id)
    seq = check_seq("seq_id", proto.seq_id)

    async def build() -> list[Call]:
        inp, work = forward_backward_input(proto, await catalog.limits(job.spec.base_model))
        if inp.backward:
            return [Call(Function.FORWARD_BACKWARD, inp, ResponseKind.FORWARD_BACKWARD, work=work)]
        return [Call(Function.FORWARD, inp, ResponseKind.FORWARD, work=work)]

    return await _submit_training(job, seq, build, submit)


@router.post("/optim_step")
async def optim_step(
    body: OptimStepBody, tenant: Tenant, jobs: Jobs, submit: Submit
) -> dict[str, Any]:
    job = await jobs.training_model(tenant, body.model_id)

    async def build() -> list[Call]:
        inp = OptimStepInput(adam_params(body))
        return [Call(Function.OPTIM_STEP, inp, ResponseKind.OPTIM_STEP)]

    return await _submit_training(job, check_seq("seq_id", body.seq_id), build, submit)


@router.post("/save_weights")
async def save_weights(
    body: SaveWeightsBody, tenant: Tenant, jobs: Jobs, submit: Submit
) -> dict[str, Any]:
    job = await jobs.training_model(tenant, body.model_id)
    seq = check_seq("seq_id", body.seq_id)

    async def build() -> list[Call]:
        name = checkpoint_name(body.path, f"step-{seq}")
        path = TinkerPath(job.job_id, CheckpointKind.WEIGHTS, name)
        standing = await jobs.find_checkpoint(tenant, str(path))
        if not body.overwrite and standing is not None:
            raise bad_request(f"checkpoint {path} exists; pass overwrite=True or pick another name")
        if standing is None:  # a new checkpoint takes a place of the tenant's quota
            await jobs.admit_checkpoint(tenant)
        await jobs.admit_save(tenant, str(path), body.ttl_seconds)
        inp = SaveInput(SaveKind.STATE, str(path))
        return [Call(Function.SAVE, inp, ResponseKind.SAVE_WEIGHTS)]

    return await _submit_training(job, seq, build, submit)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    request: Request, body: SaveWeightsForSamplerBody, tenant: Tenant, jobs: Jobs, submit: Submit
) -> dict[str, Any]:
    job = await jobs.training_model(tenant, body.model_id)
    seq = check_seq("seq_id", body.seq_id)

    async def build() -> list[Call]:
        if body.path is not None:
            name = checkpoint_name(body.path, f"step-{seq}")
            named = TinkerPath(job.job_id, CheckpointKind.SAMPLER_WEIGHTS, name)
            if await jobs.find_checkpoint(tenant, str(named)) is None:
                await jobs.admit_checkpoint(tenant)
        elif body.sampling_session_seq_id is not None:
            name = EPHEMERAL_PREFIX + str(
                check_seq("sampling_session_seq_id", body.sampling_session_seq_id)
            )
        else:
            raise bad_request(
                "save_weights_for_sampler needs a path (name) or sampling_session_seq_id"
            )
        path = TinkerPath(job.job_id, CheckpointKind.SAMPLER_WEIGHTS, name)
        await jobs.admit_save(tenant, str(path), body.ttl_seconds)
        context: dict[str, str] = {}
        session_seq = body.sampling_session_seq_id if body.path is None else None
        if session_seq is not None:
            # The ephemeral form: the server names the snapshot and opens the sampling
            # session over it, which the SDK then uses without asking anything else.
            session_id = sampling_session_id(session_of(job.job_id), session_seq)
            await jobs.put_job(sampling_job(job, session_id, str(path)))
            context[CTX_SAMPLING_SESSION] = session_id
            if not ephemeral_save_carries_path(sdk_version(request.headers)):
                context[CTX_NO_PATH] = "1"
        inp = SaveInput(
            SaveKind.SAMPLER,
            str(path),
            ephemeral=session_seq is not None,
            sampling_session=context.get(CTX_SAMPLING_SESSION, ""),
        )
        return [Call(Function.SAVE, inp, ResponseKind.SAVE_WEIGHTS_FOR_SAMPLER, context)]

    return await _submit_training(job, seq, build, submit)


@router.post("/save_weights_external")
async def save_weights_external(
    body: SaveWeightsExternalBody, tenant: Tenant, jobs: Jobs, submit: Submit
) -> dict[str, Any]:
    """The job's weights as Hugging Face files (a PEFT adapter, or a model directory for
    full fine-tuning), at `tinker://<model>/external_weights/<name>`; their signed URLs
    come from get_external_weights_urls (docs/export.md)."""
    job = await jobs.training_model(tenant, body.model_id)
    seq = check_seq("seq_id", body.seq_id)
    recipients = body.age_encryption_recipients or []
    try:
        age_encryption.parse_recipients(recipients)
    except age_encryption.RecipientError as exc:
        raise bad_request(str(exc)) from None

    async def build() -> list[Call]:
        name = checkpoint_name(body.path, f"step-{seq}")
        path = TinkerPath(job.job_id, CheckpointKind.EXTERNAL_WEIGHTS, name)
        if await jobs.find_checkpoint(tenant, str(path)) is not None:
            raise bad_request(
                f"checkpoint {path} exists; delete it first or pick another name (its "
                "signed URLs keep naming the files they were signed for)"
            )
        await jobs.admit_checkpoint(tenant)
        # The TTL's range, the bytes quota; the record takes the TTL when it lands.
        await jobs.admit_save(tenant, str(path), body.ttl_seconds)
        export = ExportOptions(age_recipients=recipients)
        inp = SaveInput(SaveKind.EXTERNAL, str(path), export=export)
        return [Call(Function.SAVE, inp, ResponseKind.SAVE_WEIGHTS_EXTERNAL)]

    return await _submit_training(job, seq, build, submit)


@router.post("/load_weights")
async def load_weights(
    body: LoadWeightsBody, tenant: Tenant, jobs: Jobs, catalog: Catalog, submit: Submit
) -> dict[str, Any]:
    if body.session_id is not None and body.model_seq_id is not None:
        return await _create_from_state(body, tenant, jobs, catalog, submit)
    if body.model_id is None:
        raise bad_request("load_weights needs model_id and seq_id, or session_id and model_seq_id")
    job = await jobs.training_model(tenant, body.model_id)

    async def build() -> list[Call]:
        ckpt = await _loadable(body, tenant, jobs)
        rank = job.spec.lora.rank if job.spec.lora else None
        if ckpt.base_model != job.spec.base_model or ckpt.lora_rank != rank:
            raise bad_request(
                f"checkpoint {ckpt.path} is {_describe(ckpt.base_model, ckpt.lora_rank)}, but "
                f"model {job.job_id} is {_describe(job.spec.base_model, rank)}; load it into a "
                "matching model (or create one from it with create_training_client_from_state)"
            )
        inp = LoadInput(ckpt.path, body.optimizer)
        return [Call(Function.LOAD, inp, ResponseKind.LOAD_WEIGHTS, {CTX_MODEL_ID: job.job_id})]

    return await _submit_training(job, check_seq("seq_id", body.seq_id), build, submit)


async def _create_from_state(
    body: LoadWeightsBody, tenant: str, jobs: Jobs, catalog: Catalog, submit: Submitter
) -> dict[str, Any]:
    """create_training_client_from_state: a new model (seq 0) made from a checkpoint."""
    assert body.session_id is not None and body.model_seq_id is not None
    session_id = body.session_id
    await jobs.session(tenant, session_id)
    model_id = training_model_id(session_id, check_seq("model_seq_id", body.model_seq_id))

    async def build() -> list[Call]:
        ckpt = await _loadable(body, tenant, jobs)
        if body.base_model is not None and body.base_model != ckpt.base_model:
            raise bad_request(
                f"checkpoint {ckpt.path} was trained on {ckpt.base_model!r}, not "
                f"{body.base_model!r}; leave base_model out"
            )
        # The LoRA options and seed are not in the checkpoint record: take them from the
        # model that saved it while its record lasts, else the defaults (its owner's
        # model: a published checkpoint may be another tenant's).
        origin = await jobs.find_job(ckpt.tenant, ckpt.job_id)
        lora = None
        if ckpt.lora_rank is not None:
            saved = origin.spec.lora if origin is not None else None
            same = saved is not None and saved.rank == ckpt.lora_rank
            lora = saved if same else LoraSpec(rank=ckpt.lora_rank)
        info = await catalog.info(ckpt.base_model)
        spec = JobSpec(
            base_model=ckpt.base_model,
            lora=lora,
            seed=origin.spec.seed if origin is not None else 0,
            state_bytes=state_bytes(info, lora),
        )
        metadata = metadata_strings(body.user_metadata)
        await jobs.put_job(
            new_job(JobKind.TRAINING, model_id, tenant, session_id, spec, metadata=metadata)
        )
        load = LoadInput(ckpt.path, body.optimizer)
        return [
            Call(Function.CREATE, CreateInput(spec), ResponseKind.CREATE_MODEL, spec=spec),
            Call(Function.LOAD, load, ResponseKind.LOAD_WEIGHTS, {CTX_MODEL_ID: model_id}),
        ]

    sub = Submission(model_id, tenant, 0, retry_key=model_retry_key(model_id, 0))
    return future_ref(await submit.submit(sub, build), model_id)


async def _submit_training(
    job: JobRecord, seq: int, build: CallBuilder, submit: Submitter
) -> dict[str, Any]:
    """One call in the model's seq_id stream; a re-send gets its first future back."""
    sub = Submission(job.job_id, job.tenant, seq, retry_key=model_retry_key(job.job_id, seq))
    return future_ref(await submit.submit(sub, build), job.job_id)


async def _loadable(body: LoadWeightsBody, tenant: str, jobs: Jobs) -> CheckpointRecord:
    path = parse_runnable_path(body.path)
    ckpt = await jobs.checkpoint(tenant, str(path))
    if body.optimizer and path.kind != CheckpointKind.WEIGHTS:
        raise bad_request(
            f"{path} holds sampler weights only, no optimizer state; load it without the "
            "optimizer or use a weights/ checkpoint from save_state"
        )
    return ckpt


@router.post("/unload_model")
async def unload(body: ModelIdBody, tenant: Tenant, jobs: Jobs, submit: Submit) -> dict[str, Any]:
    job = await jobs.training_model(tenant, body.model_id)
    return future_ref(await unload_model(job, jobs, submit), job.job_id)


def sampling_job(owner: JobRecord, session_id: str, path: str) -> JobRecord:
    """A sampling session over a checkpoint of `owner`, a live training model."""
    spec = JobSpec(base_model=owner.spec.base_model)
    return new_job(
        JobKind.SAMPLING,
        session_id,
        owner.tenant,
        session_of(session_id),
        spec,
        sampler_path=path,
        owner_job=owner.job_id,
    )


def state_bytes(info: BaseModelInfo, lora: LoraSpec | None) -> int:
    if lora is None:
        return info.state_bytes(None)
    return info.state_bytes(
        lora.rank, attn=lora.train_attn, mlp=lora.train_mlp, unembed=lora.train_unembed
    )


def _describe(base_model: str, rank: int | None) -> str:
    return f"{base_model!r} with LoRA rank {rank}" if rank else f"{base_model!r} fully fine-tuned"
