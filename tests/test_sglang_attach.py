"""Attaching to an SGLang server that runs already (PLEXRL_SGLANG_URL): what is checked
before a worker uses it, and that nothing here stops it. The real server is attached to
in tests/test_sglang_worker.py; these run against a stand-in HTTP server at the edge."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from plexrl_worker.sglang import SGLangServerConfig
from plexrl_worker.sglang.errors import SGLangServerError
from plexrl_worker.sglang.server import SGLangServer, check_attached

TARGETS = (*SGLangServerConfig.lora_target_modules, "lm_head")


def _info(model: Path, **over: object) -> dict[str, object]:
    info: dict[str, object] = {
        "model_path": str(model),
        "enable_lora": True,
        "max_lora_rank": 64,
        "lora_target_modules": list(TARGETS),
    }
    info.update(over)
    return info


def _config(model: Path, url: str = "http://127.0.0.1:1") -> SGLangServerConfig:
    return SGLangServerConfig(
        model_path=str(model), url=url, max_lora_rank=64, lora_target_modules=TARGETS
    )


def test_a_server_with_the_base_and_lora_settings_passes(tmp_path: Path) -> None:
    check_attached(_config(tmp_path), _info(tmp_path))
    check_attached(_config(tmp_path), _info(tmp_path, lora_target_modules=["all"]))
    check_attached(_config(tmp_path), _info(tmp_path, max_lora_rank=128))


@pytest.mark.parametrize(
    ("over", "says"),
    [
        ({"model_path": "/elsewhere/other-model"}, "--model-path"),
        ({"enable_lora": False}, "--enable-lora"),
        ({"max_lora_rank": 8}, "--max-lora-rank 64"),
        ({"lora_target_modules": ["q_proj", "v_proj"]}, "lm_head"),
    ],
)
def test_a_server_that_differs_is_refused_saying_what_to_change(
    tmp_path: Path, over: dict[str, object], says: str
) -> None:
    with pytest.raises(SGLangServerError) as info:
        check_attached(_config(tmp_path), _info(tmp_path, **over))
    assert says in str(info.value)


@pytest.fixture()
def standin(tmp_path: Path) -> Iterator[str]:
    info = json.dumps(_info(tmp_path)).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = {"/health_generate": b"", "/server_info": info}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def test_attaching_checks_the_server_and_stopping_leaves_it_running(
    tmp_path: Path, standin: str
) -> None:
    server = SGLangServer(_config(tmp_path, standin))
    server.start()
    assert server.attached and server.alive() and server.starts == 1
    assert server.url == standin.rstrip("/")
    assert not server.wait_exit(timeout_s=0.1)  # never "exited": nothing to restart
    server.stop()
    assert not server.alive()
    server.start()  # it still answers: stop did not touch it
    assert server.healthy()


def test_attaching_to_nothing_names_the_setting(tmp_path: Path) -> None:
    config = SGLangServerConfig(
        model_path=str(tmp_path), url="http://127.0.0.1:1", startup_timeout_s=0.5
    )
    with pytest.raises(SGLangServerError) as info:
        SGLangServer(config).start()
    assert "PLEXRL_SGLANG_URL" in str(info.value)
