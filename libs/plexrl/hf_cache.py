"""Make a local model resolvable by its name through the Hugging Face cache, offline.

The Tinker SDK's `SamplingClient.get_tokenizer()` calls
`AutoTokenizer.from_pretrained(<base model name>)`. With no hub reachable, that name
resolves only through the local cache (`$HF_HUB_CACHE`, by default
`~/.cache/huggingface/hub`), so we lay the model's small files out there as a
snapshot the way the hub client would have.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

# Files a tokenizer (and AutoConfig) load; weights are not needed by the SDK.
_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def hub_cache_dir() -> Path:
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache)
    home = os.environ.get("HF_HOME", str(Path.home() / ".cache" / "huggingface"))
    return Path(home) / "hub"


def register(model_dir: Path, name: str, cache: Path | None = None) -> Path | None:
    """Lay `model_dir`'s tokenizer files out as the cached snapshot of repo `name`.

    Only `org/model` names can live in the cache; returns None for others. Returns
    the snapshot directory. Idempotent: the snapshot id is a hash of the files.
    """
    if name.count("/") != 1 or name.startswith("/"):
        return None
    cache = cache or hub_cache_dir()
    files = [model_dir / f for f in _FILES if (model_dir / f).is_file()]
    digest = hashlib.sha1()
    for f in files:
        digest.update(f.name.encode())
        digest.update(f.read_bytes())
    revision = digest.hexdigest()
    repo = cache / ("models--" + name.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, snapshot / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def is_registered(name: str, cache: Path | None = None) -> bool:
    """Whether `AutoTokenizer.from_pretrained(name)` resolves offline from this cache."""
    if name.count("/") != 1 or name.startswith("/"):
        return False
    repo = (cache or hub_cache_dir()) / ("models--" + name.replace("/", "--"))
    ref = repo / "refs" / "main"
    if not ref.is_file():
        return False
    return (repo / "snapshots" / ref.read_text().strip() / "tokenizer_config.json").is_file()


def register_all(
    model_dir: Path, names: Iterable[str], cache: Path | None = None
) -> dict[str, Path]:
    """`register` under each name (a model's own and its aliases); the snapshots of those
    that can live in the cache, by name. Every alias resolves to the same files, so a
    recipe's `AutoTokenizer.from_pretrained("Qwen/Qwen3-8B")` loads the local tokenizer."""
    snapshots: dict[str, Path] = {}
    for name in dict.fromkeys(names):
        if (snapshot := register(model_dir, name, cache)) is not None:
            snapshots[name] = snapshot
    return snapshots
