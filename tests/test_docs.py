"""The docs stay true: every CLI option is documented, the README's commands exist."""

import re
from pathlib import Path

import typer

from moesim.cli import app

ROOT = Path(__file__).resolve().parents[1]


def test_every_cli_option_is_in_the_reference():
    doc = (ROOT / "docs" / "cli.md").read_text()
    command = typer.main.get_command(app)
    for name, cmd in command.commands.items():
        assert f"moesim {name}" in doc, name
        for param in cmd.params:
            for opt in param.opts:
                if opt.startswith("--"):
                    assert opt in doc, f"{name} {opt}"


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = next(line.strip() for line in readme.splitlines() if "pytest" in line and not line.startswith("#"))
    assert test_cmd in ci


def test_readme_figures_exist():
    readme = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\(([^)#]+\.(?:png|html|md))\)", readme):
        assert (ROOT / link).exists(), link
