"""The measures of issue "One deployment, resolved once", on this checkout: how far the code
is from a foundation whose rooms show the architecture.

    python bench/code_metrics.py            # the figures, one a line
    python bench/code_metrics.py --json     # the same, with every function, import and circle named

It prints, for moesim's own code (moesim/, sim/, traces/, executor/, reports/; not tests/ or
bench/):

- functions with more than 10 parameters (``self`` and ``cls`` not counted; a dataclass's
  generated ``__init__`` is a value object and is not in the source);
- function-level imports of moesim's own modules, and how many of them say why on their line
  or the line above (a comment);
- import circles among moesim's modules, counting function-level imports (strongly connected
  components of more than one module; Tarjan's algorithm); an import under ``if TYPE_CHECKING:``
  names a type for the reader and runs never, so it is not counted;
- issue 53's measures: the lines outside ``moesim/policy/`` that test a policy's flags (its
  grep), and, in a 4-policy ``moesim replay`` and a 2-policy ``moesim whatif`` on the default
  three machines, how often ``get_policy``, ``get_engine``, ``get_machine`` and ``get_host``
  resolve a name against the distinct names they resolve, and how many cost models are built
  (counted with a profile hook on their code objects, so every name bound to them counts).

Targets (the issues'): at most 5 such functions, 0 circles, 0 function-level imports of
moesim's own modules; at most 15 flag-test lines in 3 files; one resolution per distinct
name; cost models at most policies x machines (+ the report's chart). Nothing here is timed.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Source folder -> the module prefix it installs as (pyproject.toml's package-dir).
FOLDERS = {"moesim": "moesim", "sim": "moesim.sim", "traces": "moesim.traces", "executor": "moesim.executor",
           "reports": "moesim.reports"}
MAX_PARAMS = 10


def modules() -> dict[str, Path]:
    """Module name -> source file of every module of moesim's own code."""
    out = {}
    for folder, prefix in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if folder == "moesim" and parts and parts[0] in {v.split(".")[1] for v in FOLDERS.values() if "." in v}:
                continue  # a shadow copy of a mapped folder (none expected)
            out[".".join([prefix, *parts])] = path
    return out


def _resolve(name: str, level: int, here: str, is_package: bool) -> str:
    """The absolute module an ``import`` / ``from`` names (relative imports resolved)."""
    if not level:
        return name
    base = here.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _targets(node: ast.AST, here: str, is_package: bool, known: set[str]) -> list[str]:
    """moesim's own modules an import node imports (``from m import x`` counts x when x is a module)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        mod = _resolve(node.module or "", node.level, here, is_package)
        names = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
    out = []
    for n in names:
        while n and n not in known:  # import moesim.sim.sweep -> that module; import moesim.x.y where y is a name
            n = n.rpartition(".")[0]
        if n and n.startswith("moesim"):
            out.append(n)
    return sorted(set(out))


def scan() -> dict:
    mods = modules()
    known = set(mods)
    wide, local, edges = [], [], {m: set() for m in mods}
    for mod, path in mods.items():
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        tree = ast.parse(text, str(path))
        is_package = path.name == "__init__.py"
        funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        for f in funcs:
            a = f.args
            params = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + \
                     [x.arg for x in (a.vararg, a.kwarg) if x is not None]
            params = [p for p in params if p not in ("self", "cls")]
            if len(params) > MAX_PARAMS:
                wide.append({"function": f"{mod}.{f.name}", "params": len(params),
                             "where": f"{path.relative_to(ROOT)}:{f.lineno}"})
        inside = {id(n) for f in funcs for n in ast.walk(f) if isinstance(n, ast.Import | ast.ImportFrom)}
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in
                       ast.unparse(block.test) for n in ast.walk(block) if isinstance(n, ast.Import | ast.ImportFrom)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom) or id(node) in typing_only:
                continue
            targets = [t for t in _targets(node, mod, is_package, known) if t != mod]
            edges[mod].update(targets)
            if id(node) in inside and targets:
                said = "#" in lines[node.lineno - 1] or (node.lineno > 1 and lines[node.lineno - 2].strip()
                                                          .startswith("#"))
                local.append({"in": f"{path.relative_to(ROOT)}:{node.lineno}", "imports": targets, "says_why": said})
    return {"modules": len(mods), "wide_functions": sorted(wide, key=lambda w: -w["params"]),
            "function_level_imports": local, "circles": circles(edges)}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on, stack, out = set(), [], []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out, key=len, reverse=True)


#: Issue 53's grep: a policy's flags tested outside the policy package.
FLAG_TESTS = r"\b(p|pol|policy|self\.policy)\.(cpu|offload|oracle|prefetch|caches|executes_predicted|exact)\b"

#: The commands whose name resolutions and cost models issue 53 counts (a trace is synthesised first).
COMMANDS = {
    "4-policy replay": ["replay", "t.npz", "--hw", "a6000", "--policy", "on-demand,prefetch-fom,prefetch-spec,oracle",
                        "--json"],
    "2-policy whatif": ["whatif", "--policy", "prefetch-fom,cpu-on-miss", "--tokens", "16", "--jobs", "1", "--out", "w"],
}


def flag_tests() -> dict:
    """Lines (and files) outside ``moesim/policy/`` that test a policy's flags (issue 53's grep;
    a Planner's ``prefetch(...)`` call is a method, not a flag, and is not counted)."""
    import re
    import subprocess

    out = subprocess.run(["git", "grep", "-nE", FLAG_TESTS, "--", ":!moesim/policy/"], cwd=ROOT, capture_output=True,
                         text=True).stdout.splitlines()
    lines = [ln for ln in out if not re.search(r"\.prefetch\(", ln)]
    return {"flag_test_lines": len(lines), "flag_test_files": sorted({ln.split(":", 1)[0] for ln in lines})}


def resolutions(argv: list[str]) -> dict:
    """For one ``moesim`` command run in this process: how often each of get_policy, get_engine,
    get_machine and get_host resolves a name (its first argument a string, or None: the
    default, or a GPU's own host) against the distinct names it resolves, and how many cost
    models are built. Counted with a profile hook on their code objects, so every name bound
    to them counts; a resolved object passed through is not a resolution."""
    import moesim.cli
    from moesim.cli.argv import load_commands
    from moesim.costmodel import CostModel
    from moesim.engines import get_engine
    from moesim.hardware import get_host, get_machine
    from moesim.policy import get_policy

    load_commands(argv)  # the command's modules imported first: their tables are built once a process, not a run
    watched = {f.__code__: f.__name__ for f in (get_policy, get_engine, get_machine, get_host)}
    calls = {n: 0 for n in watched.values()}
    names: dict[str, set] = {n: set() for n in watched.values()}
    built = [0]

    def hook(frame, event, arg):
        if event != "call":
            return
        if frame.f_code is CostModel.__init__.__code__:
            built[0] += 1
        elif frame.f_code in watched:
            first = frame.f_locals.get(frame.f_code.co_varnames[0])
            if first is None or isinstance(first, str):
                who = watched[frame.f_code]
                gpu = frame.f_locals.get("gpu")  # get_host(None, gpu): the GPU's own host
                calls[who] += 1
                names[who].add(first if first is not None or gpu is None else gpu.host)

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        sys.argv = ["moesim", *argv]
        sys.setprofile(hook)
        try:
            moesim.cli.main()
        except SystemExit as e:
            if e.code:
                raise RuntimeError(f"moesim {' '.join(argv)} failed (exit {e.code})") from None
        finally:
            sys.setprofile(None)
    return {"command": "moesim " + " ".join(argv), "cost_models": built[0],
            **{f"{n}_resolutions": calls[n] for n in calls}, **{f"{n}_names": sorted(map(str, names[n])) for n in names}}


def all_resolutions() -> dict[str, dict]:
    """:func:`resolutions` of each of :data:`COMMANDS`, in a fresh folder."""
    import subprocess

    os.environ.setdefault("MPLBACKEND", "Agg")
    sys.path.insert(0, str(ROOT))
    out = {}
    with tempfile.TemporaryDirectory() as d, contextlib.chdir(d):
        subprocess.run([sys.executable, "-m", "moesim", "synth", "--model", "olmoe-1b-7b", "--tokens", "32", "--seed",
                        "3", "--out", "t.npz"], check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        for what, argv in COMMANDS.items():
            out[what] = resolutions(argv)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="every function, import and circle, as JSON")
    args = ap.parse_args()
    res = {**scan(), **flag_tests(), "resolutions": all_resolutions()}
    if args.json:
        print(json.dumps(res, indent=2))
        return
    local = res["function_level_imports"]
    print(f"modules: {res['modules']}")
    print(f"functions with more than {MAX_PARAMS} parameters: {len(res['wide_functions'])} (target at most 5); "
          f"widest: " + ", ".join(f"{w['function']} ({w['params']})" for w in res["wide_functions"][:5]))
    print(f"function-level imports of moesim's own modules: {len(local)} ({sum(x['says_why'] for x in local)} say "
          "why; target 0)")
    print(f"import circles counting function-level imports: {len(res['circles'])} (target 0); sizes "
          + ", ".join(str(len(c)) for c in res["circles"]))
    for c in res["circles"]:
        print(f"  circle of {len(c)}: {', '.join(m.removeprefix('moesim.') for m in c)}")
    print(f"flag tests outside moesim/policy/: {res['flag_test_lines']} lines in {len(res['flag_test_files'])} files "
          f"(target at most 15 in 3): {', '.join(res['flag_test_files'])}")
    for what, r in res["resolutions"].items():
        per = ", ".join(f"{n} {r[n + '_resolutions']} for {len(r[n + '_names'])}"
                        for n in ("get_policy", "get_engine", "get_machine", "get_host"))
        print(f"{what} (`{r['command']}`): name resolutions for distinct names: {per} (target one a name); "
              f"cost models built: {r['cost_models']}")


if __name__ == "__main__":
    main()
