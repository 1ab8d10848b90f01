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
- how many times ``get_policy`` and ``get_engine`` run in one two-policy ``moesim whatif``
  (counted with a profile hook on their code objects, so every name bound to them counts),
  against the distinct names they resolve.

Targets (the issue's): at most 5 such functions, 0 circles, 0 function-level imports of
moesim's own modules, one call per distinct name. Nothing here is timed.
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


def resolutions() -> dict:
    """Calls of get_policy / get_engine in one two-policy ``moesim whatif`` (in this process)."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    sys.path.insert(0, str(ROOT))
    import moesim.cli
    from moesim.engines import get_engine
    from moesim.policy import get_policy

    watched = {get_policy.__code__: "get_policy", get_engine.__code__: "get_engine"}
    calls = {n: 0 for n in watched.values()}
    names: dict[str, set] = {n: set() for n in watched.values()}

    def hook(frame, event, arg):
        if event == "call" and frame.f_code in watched:
            who = watched[frame.f_code]
            calls[who] += 1
            first = frame.f_locals.get(frame.f_code.co_varnames[0])
            names[who].add(getattr(first, "name", first))

    argv = ["moesim", "whatif", "--model", "qwen3-30b-a3b", "--hw", "rtx4090", "--policy", "on-demand,cpu-static",
            "--tokens", "16", "--jobs", "1"]
    with tempfile.TemporaryDirectory() as d, contextlib.chdir(d), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        sys.argv = argv
        sys.setprofile(hook)
        try:
            moesim.cli.main()
        except SystemExit as e:
            if e.code:
                raise RuntimeError(f"the whatif failed (exit {e.code})") from None
        finally:
            sys.setprofile(None)
    return {"command": " ".join(argv), **{f"{n}_calls": calls[n] for n in calls},
            **{f"{n}_names": sorted(map(str, names[n])) for n in names}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="every function, import and circle, as JSON")
    args = ap.parse_args()
    res = {**scan(), **resolutions()}
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
    for n in ("get_policy", "get_engine"):
        print(f"{n} calls in `{res['command']}`: {res[n + '_calls']} for {len(res[n + '_names'])} distinct names "
              "(target one a name)")


if __name__ == "__main__":
    main()
