"""The SGLang sampler: Tinker's `sample` served by an SGLang server child process
(docs/sglang.md). Import-light: nothing here imports sglang, which lives in its own venv."""

from plexrl_worker.sglang.errors import SGLangServerError, SGLangUnsupportedError
from plexrl_worker.sglang.files import write_full_weights, write_lora_adapter
from plexrl_worker.sglang.sampler import SGLangSampler
from plexrl_worker.sglang.server import SGLangServer, SGLangServerConfig, sglang_python

__all__ = [
    "SGLangSampler",
    "SGLangServer",
    "SGLangServerConfig",
    "SGLangServerError",
    "SGLangUnsupportedError",
    "sglang_python",
    "write_full_weights",
    "write_lora_adapter",
]
