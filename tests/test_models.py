"""Tiny models built locally, and the registry that serves base models by name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

# No hub is reachable: anything that tried one would fail here instead of hanging.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from plexrl.models import (
    INFO_JSON,
    THINK_TOKENS,
    ModelRegistry,
    TinyShape,
    UnknownModelError,
    init_tiny,
)

TINY = "plexrl/tiny-qwen3"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("models") / "tiny")


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_init_tiny_is_deterministic(tiny_dir: Path, tmp_path: Path) -> None:
    again = init_tiny(tmp_path / "again")
    assert _files(again) == _files(tiny_dir)

    other = init_tiny(tmp_path / "other", seed=1)
    weights = "model.safetensors"
    assert (other / weights).read_bytes() != (tiny_dir / weights).read_bytes()
    # The tokenizer does not depend on the seed: models of one family share a vocabulary.
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    assert json.loads((other / "plexrl.json").read_text()) == {
        "name": TINY,
        "family": "qwen3",
        "seed": 1,
    }


def test_tiny_loads_offline_and_runs(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size == len(tok)
    assert 256 < len(tok) <= 1024

    specials = {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}
    assert None not in specials and len(specials) == 3
    assert model.config.eos_token_id == tok.eos_token_id

    text = "copy: Hello, World! 12+7=19"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok))
    assert torch.isfinite(logits).all()


def test_every_digit_is_its_own_token(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert tok("12+7=19").input_ids == [tok.convert_tokens_to_ids(c) for c in "12+7=19"]
    for token in tok.get_vocab():
        if any(c.isdigit() for c in token):
            assert len(token) == 1, f"token {token!r} joins a digit with something else"
    assert len(tok(" 4096").input_ids) == 5  # the space, then one token per digit


def test_max_positions_changes_the_config_and_no_weight(tiny_dir: Path, tmp_path: Path) -> None:
    # Rotary positions have no weights: a longer model is today's model with a longer limit.
    long = init_tiny(tmp_path / "long", shape=TinyShape(max_positions=4096))
    weights = "model.safetensors"
    assert (long / weights).read_bytes() == (tiny_dir / weights).read_bytes()
    assert json.loads((long / "config.json").read_text())["max_position_embeddings"] == 4096
    assert AutoTokenizer.from_pretrained(long).model_max_length == 4096
    assert ModelRegistry(tmp_path).info(str(long)).max_positions == 4096
    with pytest.raises(ValueError, match="at least 16"):
        TinyShape(max_positions=8)


def test_think_tokens_are_single_tokens_after_the_trained_ids(
    tiny_dir: Path, tmp_path: Path
) -> None:
    think = init_tiny(tmp_path / "think", think_tokens=True)
    plain, tok = AutoTokenizer.from_pretrained(tiny_dir), AutoTokenizer.from_pretrained(think)
    ids = [tok.encode(t, add_special_tokens=False) for t in THINK_TOKENS]
    assert ids == [[len(plain) + i] for i in range(len(THINK_TOKENS))]
    assert AutoModelForCausalLM.from_pretrained(think).config.vocab_size == len(tok)
    # Every other text keeps its ids, and the tags decode back to themselves.
    text = "<|im_start|>user\nWhat is 12+3?<|im_end|>\n"
    assert tok.encode(text) == plain.encode(text)
    assert tok.decode(tok.encode("a<think>b</think>c")) == "a<think>b</think>c"
    # Not special (as in Qwen's tokenizers): skipping special tokens keeps them.
    assert (
        tok.decode(tok.encode("<think>x</think>"), skip_special_tokens=True) == "<think>x</think>"
    )
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": " hi "}],
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=False,
    )
    assert (
        prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_llama_family(tmp_path: Path) -> None:
    d = init_tiny(tmp_path / "llama", family="llama", name="tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(d)
    assert model.config.model_type == "llama"
    info = ModelRegistry(tmp_path).info("tiny-llama")
    assert info.family == "llama" and info.arch == "LlamaForCausalLM"


def test_registry_names_and_resolve(tiny_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "models"
    shutil.copytree(tiny_dir, root / "a")
    # Without a plexrl.json, the directory name is the model's name.
    shutil.copytree(tiny_dir, root / "plain", ignore=shutil.ignore_patterns("plexrl.json"))
    (root / "not-a-model").mkdir()
    registry = ModelRegistry(root)

    assert registry.names() == ["plain", TINY]
    assert registry.resolve(TINY) == root / "a"
    assert registry.resolve("plain") == root / "plain"
    # Any local HF directory by absolute path, even outside the root.
    assert registry.resolve(str(tiny_dir)) == tiny_dir

    with pytest.raises(UnknownModelError) as err:
        registry.resolve("Qwen/Qwen3-8B")
    assert err.value.available == ["plain", TINY]
    assert "Qwen/Qwen3-8B" in str(err.value) and TINY in str(err.value)


def test_registry_rejects_two_models_of_one_name(tiny_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_dir, tmp_path / "one")
    shutil.copytree(tiny_dir, tmp_path / "two")
    with pytest.raises(ValueError, match="both named"):
        ModelRegistry(tmp_path).names()


def test_info_reads_config_only(tiny_dir: Path, tmp_path: Path) -> None:
    # A directory with the config and no weights at all: info must still work.
    (tmp_path / "configonly").mkdir()
    for name in ("config.json", "plexrl.json"):
        shutil.copy(tiny_dir / name, tmp_path / "configonly" / name)
    info = ModelRegistry(tmp_path).info(TINY)

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert info.num_params == sum(p.numel() for p in model.parameters())
    assert info.vocab_size == model.config.vocab_size
    assert info.hidden_size == model.config.hidden_size
    assert info.num_layers == model.config.num_hidden_layers
    assert info.max_positions == 512
    assert info.eos_token_id == model.config.eos_token_id
    assert (info.family, info.arch) == ("qwen3", "Qwen3ForCausalLM")

    targets = info.lora_targets()
    assert "model.layers.0.self_attn.q_proj" in targets
    assert "model.layers.1.mlp.down_proj" in targets
    assert "lm_head" not in targets
    assert "lm_head" in info.lora_targets(attn=False, mlp=False, unembed=True)

    # fp32 weights, gradients and two Adam moments: 16 bytes per trainable parameter.
    assert info.state_bytes(None) == 16 * info.num_params
    lora8 = info.lora_params(8)
    assert info.state_bytes(8) == 16 * lora8
    assert 0 < lora8 < info.num_params
    assert info.lora_params(16) == 2 * lora8


def test_the_description_is_kept_beside_the_config(tiny_dir: Path, tmp_path: Path) -> None:
    """Described once, read back after: the same info, with no module tree built."""
    assert (tiny_dir / INFO_JSON).is_file()  # init_tiny leaves it
    model = tmp_path / "m"
    model.mkdir()
    for name in ("config.json", "plexrl.json"):
        shutil.copy(tiny_dir / name, model / name)
    computed = ModelRegistry(tmp_path).info(TINY)
    assert (model / INFO_JSON).is_file()
    assert ModelRegistry(tmp_path).info(TINY) == computed  # read back, equal

    # A description of another config is not taken for this one.
    kept = json.loads((model / INFO_JSON).read_text())
    kept["info"]["num_params"] = 1
    (model / INFO_JSON).write_text(json.dumps(kept))
    assert ModelRegistry(tmp_path).info(TINY).num_params == 1  # same key: trusted
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] //= 2
    (model / "config.json").write_text(json.dumps(config))
    narrower = ModelRegistry(tmp_path).info(TINY)
    assert 1 < narrower.num_params < computed.num_params

    # A read-only directory is described each time, without failing.
    (model / INFO_JSON).unlink()
    model.chmod(0o555)
    try:
        assert ModelRegistry(tmp_path).info(TINY) == narrower
    finally:
        model.chmod(0o755)


def test_the_gateway_loads_neither_torch_nor_transformers(tiny_dir: Path) -> None:
    """It serves descriptions only: importing torch would cost it seconds and ~700 MiB."""
    code = (
        "import sys; from plexrl.models import ModelRegistry; import plexrl_gateway.main; "
        f"ModelRegistry({str(tiny_dir.parent)!r}).info({TINY!r}); "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
