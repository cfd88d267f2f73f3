"""The `plexrl` command line: serve a service, build models, simulate, inspect."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, help="PlexRL: many RLVR jobs on one accelerator pool.")


def _mount_subcommands() -> None:
    # Each sub-app lives beside the code it drives; importing them lazily keeps
    # `plexrl --help` fast (no torch import).
    from plexrl_sim.cli import sim, sim_build
    from plexrl_tools.cli_model import app as model_app
    from plexrl_tools.cli_serve import serve
    from plexrl_tools.cli_status import register as register_status

    app.add_typer(model_app, name="model")
    app.command("serve")(serve)
    app.command("sim")(sim)
    app.command("sim-build")(sim_build)
    register_status(app)  # status, jobs, workers, timeline, top, dlq


_mount_subcommands()

if __name__ == "__main__":
    app()
