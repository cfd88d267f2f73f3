"""`plexrl model ...`: build and list local base models (no model hub needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

app = typer.Typer(no_args_is_help=True, help="Build and list local base models.")


@app.command("init-tiny")
def init_tiny(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the model into.")],
    family: Annotated[str, typer.Option(help="qwen3 or llama")] = "qwen3",
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    name: Annotated[str | None, typer.Option(help="Name the registry serves it under.")] = None,
    alias: Annotated[
        list[str] | None,
        typer.Option(
            help="A further name it is served under, e.g. Qwen/Qwen3-8B (repeatable), so "
            "recipes configured for that model family run on it."
        ),
    ] = None,
    max_positions: Annotated[
        int,
        typer.Option(
            help="Longest sequence the model accepts, prompt plus completion; multi-turn "
            "recipes want 2048 to 4096. Changes no weight (rotary positions)."
        ),
    ] = 512,  # plexrl.models.TinyShape's default, for the same reason as warm_steps'
    think_tokens: Annotated[
        bool,
        typer.Option(
            help="Add <think>, </think> and the tool-call tags as single tokens, and a chat "
            "template to match, for the Qwen3.5-family renderers (qwen3_5, "
            "qwen3_5_disable_thinking, qwen3_8_*). Widens the vocabulary: other weights."
        ),
    ] = False,
    warm_steps: Annotated[
        int, typer.Option(help="Steps of warm-up on synthetic digit tasks (0: random weights).")
    ] = 1000,  # plexrl_tools.pretrain.WARM_STEPS, the demo's base (not imported: it pulls in torch)
    hf_cache: Annotated[
        bool, typer.Option(help="Also make the name resolvable offline via the HF cache.")
    ] = True,
) -> None:
    """Build a small Qwen- or Llama-family model with a locally trained tokenizer."""
    from plexrl import hf_cache as cache
    from plexrl.models import ModelRegistry, TinyShape
    from plexrl.models import init_tiny as build

    if family not in ("qwen3", "llama"):
        raise typer.BadParameter(f"family {family!r} is not one of qwen3, llama")
    fam: Literal["qwen3", "llama"] = "qwen3" if family == "qwen3" else "llama"
    aliases = alias or []
    try:
        shape = TinyShape(max_positions=max_positions)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--max-positions") from err
    path = build(
        out_dir,
        family=fam,
        seed=seed,
        name=name,
        aliases=aliases,
        shape=shape,
        think_tokens=think_tokens,
    )
    if warm_steps > 0:
        from plexrl_tools.pretrain import pretrain

        loss = pretrain(path, steps=warm_steps, seed=seed)
        typer.echo(f"warmed for {warm_steps} steps (last loss {loss:.3f})")
    info = ModelRegistry(path.parent).info(str(path.resolve()))
    served = name or f"plexrl/tiny-{family}"
    also = f", also served as {', '.join(aliases)}" if aliases else ""
    typer.echo(
        f"wrote {served} to {path} ({info.num_params:,} parameters, "
        f"{info.max_positions} positions{also})"
    )
    if hf_cache:
        for cached, snapshot in cache.register_all(path, [served, *aliases]).items():
            typer.echo(f"tokenizer resolvable offline as {cached!r} ({snapshot})")


@app.command("cache")
def cache_models(
    registry: Annotated[
        Path, typer.Argument(help="Registry directory (e.g. a copy of compose's /models).")
    ],
) -> None:
    """Make every model of a registry resolvable offline by name via the HF cache.

    What a client on another machine needs for `get_tokenizer()`: the gateway reports
    the model's name as its tokenizer, and this lays the tokenizer files out under it.
    """
    from plexrl import hf_cache as cache
    from plexrl.models import ModelRegistry

    reg = ModelRegistry(registry)
    if not reg.models():
        raise typer.BadParameter(f"no model directories (with a config.json) under {registry}")
    for model in reg.models():
        info = reg.info(model)
        for cached, snapshot in cache.register_all(info.path, [model, *info.aliases]).items():
            typer.echo(f"tokenizer resolvable offline as {cached!r} ({snapshot})")


@app.command("list")
def list_models(
    registry: Annotated[Path, typer.Option(envvar="PLEXRL_MODEL_REGISTRY")] = Path(
        ".plexrl/models"
    ),
) -> None:
    """The base models a registry directory serves."""
    from plexrl.models import ModelRegistry

    reg = ModelRegistry(registry)
    for model in reg.models():
        info = reg.info(model)
        aliases = f"\taliases {', '.join(info.aliases)}" if info.aliases else ""
        typer.echo(
            f"{model}\t{info.path}\t{info.num_params:,} params\tvocab {info.vocab_size}{aliases}"
        )
