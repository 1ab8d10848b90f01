"""The package's layers, checked from the source (ast), without importing anything.

Layers, lowest first; a module may import its own layer and those below, never above:

0. vocabulary: ``moesim/*.py`` (models, hardware, policy, selection, atomic, errors, timing)
1. ``moesim.traces`` (``traces/``): the trace format and synthetic traces
2. ``moesim.sim`` (``sim/``) and ``moesim.executor`` (``executor/``), side by side but not
   interchangeable: the simulator never imports the executor (it must run without torch),
   and the executor imports the simulator only in the modules that validate the one
   against the other (:data:`EXECUTOR_MAY_USE_SIM`), so that every other executor module
   stays a reference implementation that knows nothing of the model it is checked by.
3. ``moesim.reports`` (``reports/``): pages built from simulations and measurements
4. ``moesim.cli`` (``moesim/cli/``) and ``moesim.__main__``: the command line. Nothing
   below it imports it.

``moesim.hwprofiles`` is data (TOML files) at layer 0. Both absolute imports and imports
inside functions count: a lazy import is still a dependency.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"moesim": 0, "traces": 1, "sim": 2, "executor": 2, "reports": 3}
PACKAGES = {"moesim.__main__": 4, "moesim.hwprofiles": 0, "moesim.traces": 1, "moesim.sim": 2, "moesim.executor": 2,
            "moesim.reports": 3, "moesim.cli": 4}
EXECUTOR_MAY_USE_SIM = {"validation.py", "validation_queues.py", "gpu_validate.py"}
CLI_MODULE_MAX_LINES = 150


def source_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package in the source tree at ``root``."""
    mods = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder).with_suffix("")
            prefix = "moesim" if folder == "moesim" else f"moesim.{folder}"
            mods[".".join([prefix, *rel.parts]).removesuffix(".__init__")] = path
    return mods


def layer(module: str) -> tuple[int, str]:
    """(layer, package) of a dotted moesim module name."""
    for pkg, n in sorted(PACKAGES.items(), key=lambda kv: -len(kv[0])):
        if module == pkg or module.startswith(pkg + "."):
            return n, pkg
    return 0, "moesim"


def imports(path: Path) -> list[str]:
    """Every moesim module ``path`` imports (``from moesim import x`` counts as moesim.x)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "moesim"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "moesim":
            found += [f"{node.module}.{a.name}" if node.module == "moesim" else node.module for a in node.names]
    return found


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for name, path in source_modules(root).items():
        here, pkg = layer(name)
        for target in imports(path):
            there, tpkg = layer(target)
            if there > here:
                bad.append(f"{path.relative_to(root)} (layer {here}) imports {target} (layer {there})")
            elif pkg == "moesim.sim" and tpkg == "moesim.executor":
                bad.append(f"{path.relative_to(root)}: the simulator imports the executor ({target})")
            elif pkg == "moesim.executor" and tpkg == "moesim.sim" and path.name not in EXECUTOR_MAY_USE_SIM:
                bad.append(f"{path.relative_to(root)}: only {sorted(EXECUTOR_MAY_USE_SIM)} may import the "
                           f"simulator ({target})")
    return bad


def test_no_module_imports_a_layer_above_its_own():
    assert violations() == []


def test_the_check_sees_upward_imports(tmp_path):
    """The checker itself, on a planted tree: upward and sideways imports are reported
    (else the test above proves nothing)."""
    upward = "def f():\n    from moesim.cli.app import app\n    from moesim.sim import simulate\n"
    for folder, code in {"traces": upward,
                         "sim": "import moesim.executor.model\n",
                         "executor": "from moesim.sim.replay import replay\n",
                         "moesim": "from moesim import reports\n"}.items():
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "planted.py").write_text(code)
    (tmp_path / "executor" / "validation.py").write_text("from moesim.sim.validate import validate_trace\n")
    bad = violations(tmp_path)
    assert len(bad) == 5, bad
    assert not any(b.startswith("executor/validation.py") for b in bad)


def test_layers_cover_every_module():
    mods = source_modules()
    assert "moesim.cli.app" in mods and "moesim.sim.replay" in mods and "moesim.executor.loading" in mods
    assert layer("moesim.models") == (0, "moesim") and layer("moesim.cli.replay") == (4, "moesim.cli")
    # the entry point catches a signal before the CLI imports: it imports the one small module that does so first
    assert sorted(set(imports(ROOT / "moesim" / "__main__.py"))) == ["moesim.cli", "moesim.stop"]
    assert imports(ROOT / "moesim" / "stop.py") == []  # the standard library's signal alone


def test_cli_command_modules_stay_thin():
    """Commands parse, call one library function and print; a long module is logic that
    belongs in the library."""
    for path in sorted((ROOT / "moesim" / "cli").glob("*.py")):
        n = len(path.read_text().splitlines())
        assert n < CLI_MODULE_MAX_LINES, f"{path.name}: {n} lines"


def executor_import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Executor module -> the executor modules it imports (at the top or inside functions)."""
    mods = {name: path for name, path in source_modules(root).items() if name.startswith("moesim.executor.")}
    return {name: {t for t in imports(path) if t in mods and t != name} for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle (as the path that closes it), by depth-first search."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_executor_has_no_import_circle():
    """No executor module imports one that imports it back, not even through a function-level
    (lazy) import: a lazy import hides a circle, it does not remove it."""
    assert cycles(executor_import_graph()) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]  # the check sees one


def test_executor_function_level_imports_only_keep_optional_dependencies_out():
    """Inside a function, the executor imports only optional or heavy third-party packages
    (transformers, matplotlib, pynvml), each saying so in a comment: its own modules and
    moesim's come at the top, where a reader sees them."""
    allowed = {"transformers", "matplotlib", "pynvml"}
    bad = []
    for path in sorted((ROOT / "executor").glob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    name = sub.module if isinstance(sub, ast.ImportFrom) else sub.names[0].name
                    top = (name or "").split(".")[0]
                    commented = "#" in lines[sub.lineno - 1] or "#" in lines[sub.lineno - 2]
                    if top not in allowed or not commented:
                        bad.append(f"{path.name}:{sub.lineno} imports {name} inside {node.name}")
    assert bad == []


#: The rooms of layer 0 (``moesim/*.py`` and ``moesim/policy/``), lowest first: each names what
#: its modules model, and a module imports its own room and those below, never one above
#: (at the top or inside a function; an annotation under ``TYPE_CHECKING`` counts too). A new
#: module joins one room here; docs/architecture.md draws the same order.
ROOMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ground", ("errors", "fmt", "jit", "jsonout", "stop", "timing", "bounds", "selection", "inputs", "outputs",
                "atomic", "gpu_detect", "host_detect", "measured")),
    ("model", ("spec", "artefacts", "gguf_file", "hf_config", "models", "quant_recipes", "layout")),
    ("machine", ("hardware",)),
    ("engine", ("engines", "engine_args", "setting")),
    ("cost", ("costmodel",)),
    ("policy", ("policy", "memory", "budget")),
)


def room(module: str) -> int | None:
    """The room (its index in :data:`ROOMS`) of a layer-0 module, None for any other."""
    parts = module.split(".")
    if len(parts) < 2 or layer(module)[1] != "moesim" or module == "moesim.__main__":
        return None
    for i, (_, names) in enumerate(ROOMS):
        if parts[1] in names:
            return i
    return -1  # a module no room holds


def room_violations(root: Path = ROOT) -> list[str]:
    bad = []
    for name, path in source_modules(root).items():
        here = room(name)
        if here is None:
            continue
        if here < 0:
            bad.append(f"{path.relative_to(root)} is in no room (tests/test_layers.py ROOMS)")
            continue
        for target in imports(path):
            there = room(target)
            if there is not None and there > here:
                bad.append(f"{path.relative_to(root)} ({ROOMS[here][0]}) imports {target} ({ROOMS[there][0]})")
    return bad


def test_arrows_point_down_inside_moesim():
    """Inside ``moesim/`` the rooms are ordered as the folders are: ground, model, machine,
    engine, cost, policy (the CLI above them all); no import runs up, so no circle can form."""
    assert room_violations() == []
    assert len(ROOMS) == len({n for n, _ in ROOMS}) and not set.intersection(*(set(m) for _, m in ROOMS))


def test_the_room_check_sees_an_arrow_up(tmp_path):
    (tmp_path / "moesim").mkdir()
    (tmp_path / "moesim" / "engines.py").write_text("from moesim.policy import get_policy\n")
    (tmp_path / "moesim" / "nowhere.py").write_text("")
    for folder in FOLDERS:
        (tmp_path / folder).mkdir(exist_ok=True)
    bad = room_violations(tmp_path)
    assert len(bad) == 2 and "engines.py (engine) imports moesim.policy (policy)" in bad[0] + bad[1], bad
