"""``moesim.cli.options.command_of``: a command whose options are a dataclass's fields gets
one typed object, with typer's parsing, defaults, errors and help, as a function's parameters
had them (the seven commands built this way keep their --help byte for byte: the docs test
checks every option is documented, the CLI tests run them)."""

from dataclasses import dataclass
from typing import Annotated

import typer
from typer.testing import CliRunner

from moesim.cli.options import command_of


@dataclass
class EchoArgs:
    """The options of a test command."""

    name: Annotated[str, typer.Argument(help="Who.")]
    times: Annotated[int, typer.Option(help="How often.")] = 2
    loud: Annotated[bool, typer.Option("--loud", help="Shout.")] = False


def _app(seen: list) -> typer.Typer:
    import moesim.cli.options as options

    app = typer.Typer()
    real, options.app = options.app, app  # register on a fresh app, not moesim's
    try:
        @command_of(EchoArgs, "echo")
        def echo(a: EchoArgs) -> None:
            """Say a name."""
            seen.append(a)

        @app.command("other")  # a second command, so typer keeps the subcommand names
        def other() -> None:
            pass
    finally:
        options.app = real
    return app


def test_the_handler_gets_one_typed_object_with_defaults_and_given_values():
    seen: list = []
    app = _app(seen)
    r = CliRunner().invoke(app, ["echo", "ada", "--times", "3"])
    assert r.exit_code == 0, r.output
    assert seen == [EchoArgs("ada", 3, False)]
    assert CliRunner().invoke(app, ["echo", "bob", "--loud"]).exit_code == 0
    assert seen[-1] == EchoArgs("bob", 2, True)


def test_typer_still_parses_refuses_and_documents_the_fields():
    seen: list = []
    app = _app(seen)
    bad = CliRunner().invoke(app, ["echo", "ada", "--times", "many"])
    assert bad.exit_code == 2 and not seen
    help_text = CliRunner().invoke(app, ["echo", "--help"]).output
    assert "Say a name." in help_text and "--times" in help_text and "How often." in help_text and "--loud" in help_text
