"""Base models without a hub: tiny models built locally, and a registry that serves them by name.

`init_tiny` writes a small causal LM with seeded random weights and a tokenizer trained
here, so tests and demos never reach a model hub. `ModelRegistry` maps base-model names
to local Hugging Face directories and describes them from `config.json` alone. A model
may also answer to aliases (say `Qwen/Qwen3-8B` for the tiny Qwen3), so that recipes
which look model names up in their own tables run on the local model of that family.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import string
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

# torch and transformers are imported where a model is built, not here: a service that
# only reads descriptions (the gateway) starts in seconds and never loads them, as long
# as each model directory holds its description (`INFO_JSON`, written on first use).
if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

Family = Literal["qwen3", "llama"]

INFO_JSON = ".plexrl-info.json"
"""A model directory's description (`BaseModelInfo` less its names), computed once from
config.json and kept beside it, keyed by the config's bytes and the transformers version
that built the module tree; rewritten when either changes, skipped if the directory is
read-only (then each process describes the model itself)."""

PLEXRL_JSON = "plexrl.json"
"""Per-model metadata file written by `init_tiny`: its "name" overrides the directory name,
and its optional "aliases" (a list of names) are served as the same model."""

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
# ChatML markers, so chat renderers written for Qwen-style models work on the tiny ones.
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
# The reasoning and tool tags of Qwen3's and Qwen3.5's tokenizers, added the way those
# tokenizers add them: one token each, but not special, so text that spells them out
# encodes to them even where special tokens are encoded literally. The Qwen3.5-family
# renderers assert that `</think>` is one token; they write the others as text.
THINK_TOKENS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# With THINK_TOKENS, the text the Qwen3.5-family renderers write (and Qwen3.5's own
# template): content trimmed, an empty think block on each assistant turn after the last
# user turn that has none, and a generation prompt that opens a think block (closed at
# once with `enable_thinking=False`).
_THINK_CHAT_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' and loop.index0 > ns.last_user"
    " and '</think>' not in message['content'] %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{{ message['content'] | trim + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '\n</think>\n\n' }}{% endif %}{% endif %}"
)

# fp32 copies a trainable parameter costs while training: the weight, its gradient,
# and AdamW's two moments.
_TRAINING_COPIES = 4
_FP32_BYTES = 4


@dataclass(frozen=True)
class TinyShape:
    """Sizes of a tiny model; the defaults train fast on two CPU cores."""

    hidden_size: int = 128
    """Width of the residual stream."""
    intermediate_size: int = 256
    """Width of each MLP's hidden layer."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention (query) heads; must divide hidden_size."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide num_heads."""
    max_positions: int = 512
    """Longest sequence (prompt plus completion) the model accepts. Rotary positions
    have no weights, so this changes config.json and the tokenizer's limit only: the
    same seed gives the same weights at any length."""
    vocab_size: int = 768
    """Target size of the trained BPE vocabulary, special tokens included."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}; "
                "change one so that it divides the other"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                f"{self.num_kv_heads}; pick num_kv_heads among the divisors of num_heads"
            )
        if self.max_positions < 16:
            raise ValueError(
                f"max_positions {self.max_positions} leaves no room for a prompt and its "
                "completion; use at least 16 (multi-turn recipes want 2048 to 4096)"
            )
        if self.vocab_size < 300:
            raise ValueError(
                f"vocab_size {self.vocab_size} cannot hold the 256 byte tokens plus specials "
                "and merges; use at least 300"
            )


def init_tiny(
    out_dir: Path,
    *,
    family: Family = "qwen3",
    seed: int = 0,
    name: str | None = None,
    shape: TinyShape | None = None,
    aliases: Sequence[str] = (),
    think_tokens: bool = False,
) -> Path:
    """Write a tiny causal LM with seeded random weights and a locally trained tokenizer.

    `aliases` are further names the registry serves it under. `think_tokens` adds
    THINK_TOKENS after the trained vocabulary (every other token keeps its id) and the
    chat template the Qwen3.5-family renderers match; it widens the vocabulary, so the
    weights differ from a model without them. The same arguments always give
    bit-identical files. Returns `out_dir`.
    """
    shape = shape or TinyShape()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = _tiny_tokenizer(shape, think_tokens=think_tokens)
    config = _tiny_config(family, shape, tokenizer)
    # A forked RNG keeps the caller's global torch RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    meta: dict[str, object] = {
        "name": name or f"plexrl/tiny-{family}",
        "family": family,
        "seed": seed,
    }
    if aliases:
        meta["aliases"] = _checked_aliases(list(aliases), out_dir / PLEXRL_JSON)
    (out_dir / PLEXRL_JSON).write_text(json.dumps(meta, indent=2) + "\n")
    _describe(str(meta["name"]), out_dir)  # writes INFO_JSON while torch is loaded anyway
    return out_dir


def _tiny_config(
    family: Family, shape: TinyShape, tok: PreTrainedTokenizerFast
) -> PretrainedConfig:
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=len(tok),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.hidden_size // shape.num_heads,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=shape.tie_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if family == "qwen3":
        return Qwen3Config(**common)
    if family == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"unknown tiny model family {family!r}; use 'qwen3' or 'llama'")


def _tiny_tokenizer(shape: TinyShape, *, think_tokens: bool = False) -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits are split one by one before byte-level BPE, so no merge can join them:
    # every digit is its own token, which the arithmetic rewards rely on.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=shape.vocab_size,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *CHAT_TOKENS],
        # The full byte alphabet makes any text encodable, even what the corpus lacks.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(CHAT_TOKENS),
        model_max_length=shape.max_positions,
    )
    fast.chat_template = _CHAT_TEMPLATE
    if think_tokens:
        # After training, so the trained vocabulary's ids stay what they are without.
        fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
        fast.chat_template = _THINK_CHAT_TEMPLATE
    return fast


def _synthetic_corpus(lines: int = 1500) -> Iterator[str]:
    """Arithmetic, copying and word-like text from a fixed RNG: the demo tasks' alphabet."""
    rng = random.Random(20240531)
    words = string.ascii_letters
    yield string.printable
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        yield f"{a}+{b}={a + b}"
        yield f"{a}-{b}={a - b}"
        yield f"{a}*{b}={a * b}"
        word = "".join(rng.choice(words) for _ in range(rng.randint(1, 8)))
        yield f"copy: {word} -> {word}"
        sentence = " ".join(
            "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 7)))
            for _ in range(rng.randint(3, 9))
        )
        yield sentence.capitalize() + rng.choice(".!?,;:")
        yield f"Q: What is {a} + {b}? A: {a + b}"


class UnknownModelError(LookupError):
    """A base-model name the registry cannot resolve."""

    def __init__(self, name: str, available: list[str], root: Path) -> None:
        listing = ", ".join(available) if available else "none"
        super().__init__(
            f"unknown base model {name!r}; available: {listing}. A model is a directory with a "
            f"config.json under {root} (named by its plexrl.json), or an absolute path to one"
        )
        self.name = name
        self.available = available


@dataclass(frozen=True)
class LinearShape:
    """One linear layer LoRA may adapt."""

    module: str
    """Full module path in the model, e.g. `model.layers.0.self_attn.q_proj`."""
    group: Literal["attn", "mlp", "unembed", "other"]
    """Which LoRA option covers it (`train_attn`, `train_mlp`, `train_unembed`); `other`: none."""
    in_features: int
    out_features: int


@dataclass(frozen=True)
class BaseModelInfo:
    """What the scheduler and gateway need to know about a base model, from config.json alone."""

    name: str
    path: Path
    family: str
    """The config's `model_type`, e.g. `qwen3`."""
    arch: str
    """The config's first architecture class, e.g. `Qwen3ForCausalLM`."""
    vocab_size: int
    num_params: int
    hidden_size: int
    num_layers: int
    max_positions: int
    eos_token_id: int | None
    linears: tuple[LinearShape, ...]
    """Every linear layer, for LoRA targets and sizes."""
    aliases: tuple[str, ...] = ()
    """Further names the registry serves this model under (`name` is the canonical one)."""

    def lora_targets(
        self, *, attn: bool = True, mlp: bool = True, unembed: bool = False
    ) -> list[str]:
        """Module paths a LoRA with these options adapts."""
        groups = {g for g, on in (("attn", attn), ("mlp", mlp), ("unembed", unembed)) if on}
        return [lin.module for lin in self.linears if lin.group in groups]

    def lora_params(
        self, rank: int, *, attn: bool = True, mlp: bool = True, unembed: bool = False
    ) -> int:
        """Trainable parameters of a LoRA: A (rank x in) and B (out x rank) per target."""
        targets = set(self.lora_targets(attn=attn, mlp=mlp, unembed=unembed))
        return sum(
            rank * (lin.in_features + lin.out_features)
            for lin in self.linears
            if lin.module in targets
        )

    def state_bytes(
        self,
        lora_rank: int | None,
        *,
        attn: bool = True,
        mlp: bool = True,
        unembed: bool = False,
    ) -> int:
        """Peak bytes of a job's own state in fp32: weights, gradients and both Adam moments.

        `lora_rank=None` means full fine-tuning (the job owns every weight); otherwise only
        the adapters count, since the base weights are shared by all jobs on a worker.
        """
        if lora_rank is None:
            trainable = self.num_params
        else:
            trainable = self.lora_params(lora_rank, attn=attn, mlp=mlp, unembed=unembed)
        return trainable * _TRAINING_COPIES * _FP32_BYTES


@dataclass(frozen=True)
class _Served:
    """One model directory and every name it answers to."""

    name: str
    path: Path
    aliases: tuple[str, ...]


class ModelRegistry:
    """Base models by name or alias, from the subdirectories of `root` (rescanned on each
    call, so models written after start-up are found)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._info: dict[Path, BaseModelInfo] = {}

    def names(self) -> list[str]:
        """Every name served, aliases included: what a client may pass as base model."""
        return sorted(self._scan())

    def models(self) -> list[str]:
        """The canonical name of each model directory, aliases left out."""
        return sorted({served.name for served in self._scan().values()})

    def resolve(self, name: str) -> Path:
        """The directory of a model, by registry name, alias or absolute path."""
        path = Path(name)
        if path.is_absolute() and (path / "config.json").is_file():
            return path
        return self._served(name).path

    def info(self, name: str) -> BaseModelInfo:
        """Describe a model without reading its weights (the module is built on `meta`).

        An alias describes the same model as its canonical name: `info.name` is the
        canonical name either way, and `info.aliases` lists the others."""
        path = Path(name)
        if path.is_absolute() and (path / "config.json").is_file():
            served = _Served(name, path, ())
        else:
            served = self._served(name)
        cached = self._info.get(served.path)
        if cached is None or (cached.name, cached.aliases) != (served.name, served.aliases):
            cached = self._info[served.path] = _describe(served.name, served.path, served.aliases)
        return cached

    def _served(self, name: str) -> _Served:
        found = self._scan().get(name)
        if found is None:
            raise UnknownModelError(name, self.names(), self.root)
        return found

    def _scan(self) -> dict[str, _Served]:
        """Every served name (canonical or alias) to its model."""
        if not self.root.is_dir():
            return {}
        found: dict[str, _Served] = {}
        for sub in sorted(self.root.iterdir()):
            if not (sub / "config.json").is_file():
                continue
            declared_name, aliases = _declared(sub)
            served = _Served(declared_name or sub.name, sub, aliases)
            for model_name in (served.name, *served.aliases):
                if model_name in found:
                    raise ValueError(
                        f"two model directories are both named {model_name!r} (as name or "
                        f"alias): {found[model_name].path} and {sub}; change the name or "
                        f"aliases in one of their {PLEXRL_JSON} files"
                    )
                found[model_name] = served
        return found


def _declared(model_dir: Path) -> tuple[str | None, tuple[str, ...]]:
    """The name and aliases a model directory's plexrl.json declares."""
    meta_file = model_dir / PLEXRL_JSON
    if not meta_file.is_file():
        return None, ()
    meta = json.loads(meta_file.read_text())
    name = meta.get("name")
    aliases = _checked_aliases(meta.get("aliases", []), meta_file)
    return (str(name) if name else None), tuple(a for a in aliases if a != name)


def _checked_aliases(aliases: object, where: Path) -> list[str]:
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise ValueError(
            f"{where}: aliases must be a list of non-empty names, like "
            f'["Qwen/Qwen3-8B"]; got {aliases!r}'
        )
    for alias in aliases:
        if alias.startswith("/"):
            raise ValueError(f"{where}: alias {alias!r} starts with '/', which means a path")
    return list(dict.fromkeys(aliases))


def _describe(name: str, path: Path, aliases: tuple[str, ...] = ()) -> BaseModelInfo:
    """The model's description: from its INFO_JSON when that matches its config, else
    computed (and INFO_JSON written, best effort)."""
    key = _info_key(path)
    try:
        kept = json.loads((path / INFO_JSON).read_text())
        if kept.get("key") == key:
            return _info_from_json(kept["info"], name, path, aliases)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    info = _describe_module_tree(name, path, aliases)
    fields = {k: v for k, v in asdict(info).items() if k not in ("name", "path", "aliases")}
    tmp = path / f"{INFO_JSON}.{uuid.uuid4().hex}.tmp"
    try:
        tmp.write_text(json.dumps({"key": key, "info": fields}) + "\n")
        os.replace(tmp, path / INFO_JSON)
    except OSError:
        tmp.unlink(missing_ok=True)
    return info


def _info_key(path: Path) -> str:
    """What a description depends on: config.json's bytes and the transformers version."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    digest.update(metadata.version("transformers").encode())
    return digest.hexdigest()


def _info_from_json(
    fields: dict[str, Any], name: str, path: Path, aliases: tuple[str, ...]
) -> BaseModelInfo:
    linears = tuple(LinearShape(**lin) for lin in fields.pop("linears"))
    return BaseModelInfo(name=name, path=path, linears=linears, aliases=aliases, **fields)


def _describe_module_tree(name: str, path: Path, aliases: tuple[str, ...]) -> BaseModelInfo:
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    # On the meta device no memory is allocated and no weights are read, yet the
    # module tree (and so parameter counts and linear shapes) is exact.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    unembed = model.get_output_embeddings()
    linears = tuple(
        LinearShape(
            module=module_name,
            group=_linear_group(module_name, module is unembed),
            in_features=module.in_features,
            out_features=module.out_features,
        )
        for module_name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    )
    eos = config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    text_config = config.get_text_config()
    return BaseModelInfo(
        name=name,
        path=path,
        family=str(config.model_type),
        arch=(config.architectures or [type(model).__name__])[0],
        vocab_size=int(text_config.vocab_size),
        num_params=sum(p.numel() for p in model.parameters()),
        hidden_size=int(text_config.hidden_size),
        num_layers=int(text_config.num_hidden_layers),
        max_positions=int(text_config.max_position_embeddings),
        eos_token_id=eos,
        linears=linears,
        aliases=aliases,
    )


def _linear_group(module_name: str, is_unembed: bool) -> Literal["attn", "mlp", "unembed", "other"]:
    if is_unembed:
        return "unembed"
    parts = module_name.lower().split(".")
    if any("attn" in p or "attention" in p for p in parts):
        return "attn"
    if any(p in ("mlp", "feed_forward", "ffn") for p in parts):
        return "mlp"
    return "other"
