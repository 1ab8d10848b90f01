"""What :func:`moesim.cli.main` reads of the command line before typer does: an option
given an empty value (refused in one line), and which command runs (the only one whose
module is imported, :func:`load_commands`, and that typer then builds)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager

import typer.main

from moesim.cli.app import app


def empty_option(argv: list[str]) -> str | None:
    """The first option given an empty value (``--out ''``, ``--out=``), or ``"an argument"`` for
    an empty positional one (a model, trace or profile name), which no moesim option means:
    a path option would get the current folder from it (typer reads ``''``
    as ``Path('.')``), a list option its default, before any command could tell."""
    for i, a in enumerate(argv):
        if a == "--":
            break
        if a.startswith("--") and (a.endswith("=") or (i + 1 < len(argv) and argv[i + 1] == "" and "=" not in a)):
            return a.rstrip("=")
        if a == "" and not (i and argv[i - 1].startswith("--")):  # a positional '': `models ''` read the cwd
            return "an argument"
    return None


#: Options that choose one way to print the same rows: two of them together are refused.
OUTPUT_FLAGS = ("--json", "--csv")


def clashing_flags(argv: list[str]) -> str | None:
    """A line refusing two of :data:`OUTPUT_FLAGS` given together (one would win silently)."""
    options = argv[:argv.index("--")] if "--" in argv else argv
    given = [f for f in OUTPUT_FLAGS if f in options]
    return f"{' and '.join(given)} print the same results in two ways: give one" if len(given) > 1 else None


@contextmanager
def only_command(argv: list[str]) -> Iterator[None]:
    """The app with the invoked command alone registered while it runs: typer turns every
    registered command's signature into click parameters at each start (0.15-0.3 s for
    these seventeen), though one runs. ``moesim``, ``--help``, ``--version`` and a name that is
    no command keep them all (the group's help and its "no such command" name every one)."""
    every = app.registered_commands
    keep = [c for c in every if argv and (c.name or typer.main.get_command_name(c.callback.__name__)) == argv[0]]
    if not keep:
        yield
        return
    app.registered_commands = keep
    try:
        yield
    finally:
        app.registered_commands = every


#: Each command's name and the module (moesim.cli.NAME) that registers it, in the order the
#: group's help lists them.
COMMANDS = {"calibrate": "calibrate", "ecospec": "ecospec", "fit": "fit", "hw": "hw", "import": "import_routing",
            "models": "models", "profile": "profile", "record": "record", "replay": "replay",
            "speculate": "speculate", "stats": "stats", "synth": "synth", "train": "train",
            "train-estimator": "train_estimator", "train-expert-predictor": "train_expert_predictor",
            "validate": "validate", "whatif": "whatif"}


def load_commands(argv: list[str] | None = None) -> None:
    """Register the command ``argv`` runs (its module imported), or every command when
    ``argv`` names none (``moesim``, ``--help``, ``--version``, a name that is no command:
    the group's help and its "no such command" list them all)."""
    name = argv[0] if argv else None
    for module in [COMMANDS[name]] if name in COMMANDS else COMMANDS.values():
        importlib.import_module(f"moesim.cli.{module}")


def every_command() -> typer.Typer:
    """The app with every command registered (typer's test runner invokes it directly)."""
    load_commands()
    return app
