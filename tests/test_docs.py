"""The docs stay true: every CLI option is documented, every example runs, the README's commands exist."""

import json
import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from moesim.cli import every_command

app = every_command()  # every command registered (a run registers the one it runs)

ROOT = Path(__file__).resolve().parents[1]
LONG = "long-running"
NEEDS_FILE = ("needs a dump file", "needs-file")  # reads a file no moesim command writes


def test_every_cli_option_is_in_the_reference():
    doc = (ROOT / "docs" / "cli.md").read_text()
    command = typer.main.get_command(app)
    for name, cmd in command.commands.items():
        assert f"moesim {name}" in doc, name
        for param in cmd.params:
            for opt in param.opts:
                if opt.startswith("--"):
                    assert opt in doc, f"{name} {opt}"


def help_examples() -> list[str]:
    """Every `moesim ...` span in the top-level help and each command's help, in that
    order (top level first, then commands as registered). A span followed by
    "(long-running" is skipped, as documented in docs/cli.md."""
    group = typer.main.get_command(app)
    texts = [group.help] + [cmd.help for cmd in group.commands.values()]
    found = []
    for text in texts:
        for m in re.finditer(r"`(moesim [^`]+)`(\s*\([^)]*)?", text or ""):
            if LONG not in (m.group(2) or "") and NEEDS_FILE[0] not in (m.group(2) or ""):
                found.append(" ".join(m.group(1).split()))
    return found


def doc_examples(include_long: bool = False) -> list[str]:
    """Every line starting with `moesim ` in the ```sh blocks of docs/cli.md, in order;
    a line ending in "# long-running" is skipped (unless ``include_long``)."""
    doc = (ROOT / "docs" / "cli.md").read_text()
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", doc, re.S):
        lines += [ln.strip() for ln in block.splitlines()
                  if ln.strip().startswith("moesim ") and (include_long or not ln.strip().endswith(
                      (f"# {LONG}", f"# {NEEDS_FILE[1]}")))]
    return lines


def run_in_order(examples: list[str], cwd: Path, monkeypatch) -> None:
    """Run each example through the real CLI app, in-process (one torch import, not one per
    example), in ``cwd``; each must exit 0."""
    monkeypatch.chdir(cwd)
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    runner = CliRunner()
    try:
        for line in examples:
            args = shlex.split(line.split("  #")[0])[1:]
            r = runner.invoke(app, args)
            assert r.exit_code == 0, f"{line}\n{r.output}\n{r.exception!r}"
    finally:
        torch.set_num_threads(threads)  # commands set it; later tests expect the default


def test_examples_are_found():
    helps, docs = help_examples(), doc_examples()
    assert "moesim models" in helps and "moesim validate" not in helps
    assert any(e.startswith("moesim replay sd.npz") for e in docs)
    assert "moesim validate" not in docs  # marked long-running
    group = typer.main.get_command(app)
    documented = doc_examples(include_long=True)
    for name in group.commands:  # every command teaches by example, in its help and in the reference
        assert any(e.split("  #")[0].strip() == f"moesim {name}" or e.startswith(f"moesim {name} ")
                   for e in documented), name
        assert "Example" in (group.commands[name].help or ""), name


@pytest.mark.slow
def test_help_examples_run(tmp_path, monkeypatch):
    run_in_order(help_examples(), tmp_path, monkeypatch)


@pytest.mark.slow
def test_reference_examples_run(tmp_path, monkeypatch):
    run_in_order(doc_examples(), tmp_path, monkeypatch)


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"```[a-z]*\n(.*?)```", readme, re.S)  # the commands a reader copies
    test_cmd = next(line.strip() for block in blocks for line in block.splitlines() if "pytest" in line)
    assert test_cmd in ci.splitlines()


def test_readme_figures_exist():
    readme = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\(([^)#]+\.(?:png|html|md))\)", readme):
        if not link.startswith(("http://", "https://")):  # a source on the web, not a file of this repo
            assert (ROOT / link).exists(), link


def test_readme_quotes_are_the_committed_outputs():
    """Every README block marked ``<!-- golden: FILE -->`` is lines of that committed output
    (tests/golden/, which tests/test_golden.py regenerates and compares): a README figure that
    goes stale fails the suite. The command above the first one is the committed run's."""
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "golden"))
    from outputs import COMMANDS

    readme = (ROOT / "README.md").read_text()
    quoted = re.findall(r"<!-- golden: (\S+) -->\n```\n(.*?)```", readme, re.S)
    assert len(quoted) >= 2
    for name, block in quoted:
        golden = (ROOT / "tests" / "golden" / name).read_text().splitlines()
        for line in block.splitlines():
            assert line in golden, f"README quotes {line!r}, which tests/golden/{name} does not hold"
    args = next(a for n, a, _ in COMMANDS if n == quoted[0][0])
    cut = args[:args.index("--out")] if "--out" in args else args
    assert "moesim " + " ".join(cut) in readme


def test_readmes_benchmark_figures_are_the_committed_benchmarks():
    """The README's figures from benchmarks the suite cannot run (a llama.cpp build, the
    executor's three suites) are those of the committed results files they name: a rerun
    benchmark whose README figure is left behind fails here."""
    readme = (ROOT / "README.md").read_text()
    cal = json.loads((ROOT / "bench" / "calibrate_llamacpp.json").read_text())
    after, before = cal["calibrated"], cal["uncalibrated"]
    assert (f"{after['within_15']} of {after['rows']} within +-15% after one row ({before['within_15']} before;"
            in readme)
    s = json.loads((ROOT / "bench" / "validation-epyc.json").read_text())["summary"]
    pct = {k: f"{v['median_of_means']:.2%}" for k, v in s.items() if isinstance(v, dict)}
    said = " ".join(readme.split("**The reference executor on this machine**")[1].split("\n\n")[0].split())
    assert (f"median {pct['same-policy']} (copy policies" in said and f"by {pct['transfer from on-demand']} (18" in said
            and f"policies {pct['CPU-compute policies, same-policy']} and "
                f"{pct['CPU-compute policies, transfer from on-demand']}." in said), said


def test_the_readme_is_read_top_down_in_at_most_6000_words():
    """A newcomer's README: the workstation user's question and its answer first, at most
    6,000 words (the rest lives in docs/ and CHANGELOG.md)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.split()) <= 6000
    assert readme.index("## Your machine, first") < readme.index("## What moesim is") < readme.index("## Install")
