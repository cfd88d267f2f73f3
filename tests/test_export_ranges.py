"""Range reads: the state-store's of a blob, which exported files are served from (only
the bytes asked for, to the blob's tenant only; a range past the end refused), over a
directory and over an S3 object store, and the one range of a file a resumed download
may ask the gateway for."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from fastapi import HTTPException

from plexrl.stores import Stores
from plexrl_gateway.errors import ApiError
from plexrl_gateway.exports import requested_range
from plexrl_state_store.app import build_app, one_range
from plexrl_state_store.blobs import BlobDir, BlobStore

KEY = "/v1/blobs/ckpt/t/j/external_weights/final@e0-abc"
DATA = os.urandom(3 << 20)  # past one 1 MiB piece of the file response


@pytest_asyncio.fixture(params=["dir", "s3"])
async def store(
    request: pytest.FixtureRequest, stores: Stores, tmp_path: Path
) -> AsyncIterator[httpx.AsyncClient]:
    blobs: BlobStore = BlobDir(tmp_path)
    if request.param == "s3":
        from plexrl_state_store.s3 import S3Blobs, S3Config

        seaweedfs = request.getfixturevalue("seaweedfs")
        blobs = S3Blobs(
            S3Config(
                seaweedfs.endpoint,
                bucket="ranges",
                prefix=f"{tmp_path.name}/",
                access_key=seaweedfs.access_key,
                secret_key=seaweedfs.secret_key,
            )
        )
        blobs.ensure_bucket()
    transport = httpx.ASGITransport(app=build_app(blobs, stores.checkpoints, stores.residency))
    async with httpx.AsyncClient(transport=transport, base_url="http://store") as http:
        stored = await http.put(KEY, content=DATA, headers={"x-plexrl-tenant": "t"})
        assert stored.status_code == 200
        yield http


async def test_a_range_read_answers_just_those_bytes(store: httpx.AsyncClient) -> None:
    for first, last in [(0, 9), (5, (2 << 20) + 17), (len(DATA) - 3, len(DATA) - 1)]:
        got = await store.get(
            KEY, headers={"x-plexrl-tenant": "t", "range": f"bytes={first}-{last}"}
        )
        assert got.status_code == 206
        assert got.content == DATA[first : last + 1]
        assert int(got.headers["content-length"]) == last - first + 1
    whole = await store.get(KEY, headers={"x-plexrl-tenant": "t"})
    assert whole.status_code == 200 and whole.content == DATA


async def test_a_range_is_served_to_the_blobs_tenant_only_and_within_it(
    store: httpx.AsyncClient,
) -> None:
    other = await store.get(KEY, headers={"x-plexrl-tenant": "u", "range": "bytes=0-9"})
    assert other.status_code == 404
    past = await store.get(
        KEY, headers={"x-plexrl-tenant": "t", "range": f"bytes={len(DATA)}-{len(DATA) + 9}"}
    )
    assert past.status_code == 416
    missing = await store.get(KEY + "x", headers={"x-plexrl-tenant": "t", "range": "bytes=0-1"})
    assert missing.status_code == 404


@pytest.mark.parametrize(
    ("header", "span"),
    [
        ("bytes=10-19", (10, 19)),
        ("bytes=10-", (10, 99)),
        ("bytes=-5", (95, 99)),
        ("bytes=90-200", (90, 99)),
    ],
)
def test_one_range_of_a_blob_is_read_as_asked(header: str, span: tuple[int, int]) -> None:
    assert one_range(header, 100) == span


@pytest.mark.parametrize("header", ["bytes=100-101", "bytes=0-1,5-9", "items=0-1", "bytes=5-2"])
def test_a_range_outside_a_blob_or_of_several_parts_is_refused(header: str) -> None:
    with pytest.raises(HTTPException) as refused:
        one_range(header, 100)
    assert refused.value.status_code == 416


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("bytes=0-9", (0, 10)),
        ("bytes=90-", (90, 10)),
        ("bytes=95-200", (95, 5)),
        ("bytes=-4", (96, 4)),
        ("bytes=-400", (0, 100)),
    ],
)
def test_a_download_may_ask_for_one_range_of_a_file(
    header: str | None, expected: tuple[int, int] | None
) -> None:
    assert requested_range(header, 100) == expected


@pytest.mark.parametrize(
    "header", ["bytes=100-", "bytes=9-3", "bytes=0-1,4-5", "lines=0-1", "bytes=x-", "bytes=-0"]
)
def test_a_range_outside_the_file_or_of_several_parts_is_refused(header: str) -> None:
    with pytest.raises(ApiError) as refused:
        requested_range(header, 100)
    assert refused.value.status == 416
    assert refused.value.headers == {"content-range": "bytes */100"}
