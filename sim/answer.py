"""The deployment answer of a what-if sweep: for a model, a GPU and a host, each family's
best configuration, what bounds it, the overall winner and why, and the crossover points
(batch size, prompt length, link bandwidth) where the winner changes.

Families (docs/policies.md; from the policy registry, :func:`moesim.sim.sweep.policy_families`):
``prefetching`` (on-demand, prefetch-fom, prefetch-spec with their cache, copy queue and
top-m), ``cpu-static`` (llama.cpp ``--n-cpu-moe``), ``gpu-layers`` (llama.cpp ``-ngl``),
``weight-streaming`` (vLLM ``--cpu-offload-gb``), ``hot-experts`` (KTransformers),
``cpu-on-miss`` (Fiddler) and ``all-resident``; the
oracle is shown as the prefetching family's bound and never wins. A configuration that
does not fit in device memory is never a family's best.

Data in, data out: rows of :func:`moesim.sim.sweep.run_sweep` in, plain records out;
the CLI prints :func:`format_answer`, the report plots :func:`crossovers`.
"""

from __future__ import annotations

import contextlib
import math
import textwrap
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from moesim import fmt
from moesim.engine_args import FORMATTERS, invocation
from moesim.engines import DEFAULT_ENGINE, builtin_engines
from moesim.errors import MoesimError
from moesim.fmt import number
from moesim.hardware import HostProfile, Machine, get_machine
from moesim.layout import SPLITS, make_layout
from moesim.memory import WORKSPACE_BYTES, layout_bytes
from moesim.models import ModelSpec, model_file, model_named
from moesim.policy import of_row
from moesim.quant_recipes import store_as
from moesim.setting import Setting
from moesim.sim.intervals import NOMINAL, range_text
from moesim.sim.static import layout_for
from moesim.sim.sweep import BOUND, GOALS, NOT_RUN, policy_families, simplicity

# The families and their tie order come from the policy registry (moesim.sim.sweep).
AXES = {"batch": "batch size", "prompt_len": "prompt length, tokens", "link_gbps": "link, GB/s"}
Scenario = tuple[str, str, str, int, int, float]  # (model, hw, host, batch, prompt_len, link_gbps)


def _ok(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def configuration(row: dict[str, Any]) -> str:
    """The knobs of ``row`` that its family has, in words (short: it goes in a table)."""
    dtype = row["expert_dtype"]
    what = of_row(row).row_words(row)  # the family's own words
    if row.get("split") == "tensor":  # the multi-GPU knobs, where they were given (the table had no column)
        what += ", tensor split"
    elif row.get("tensor_split") not in (None, "-"):
        what += f", split {row['tensor_split']}"
    return f"{what}, {dtype}"


def bound_words(row: dict[str, Any]) -> str:
    """One clause on what bounds ``row`` (its ``bound`` column, :func:`moesim.sim.sweep.bound_of`)."""
    b = row["bound"]
    if b == "link":
        return f"copies over the host link take most of its time ({number(row['copy_ms'])} ms of link per token)"
    if b == "CPU compute":
        return f"experts computed on the host CPU dominate ({number(row['cpu_ms'])} ms of CPU per token)"
    if b == "GPU compute":
        return f"the GPU's own work dominates ({number(row['compute_ms'])} ms per token)"
    return "it does not fit in device memory"


@dataclass
class FamilyBest:
    family: str
    row: dict[str, Any] | None  # its best fitting configuration, None when none fits or it was not swept
    configurations: int  # rows of this family in the scenario
    fitting: int
    run: int = -1  # rows the machine could run at all (-1: every row); the rest are whatif.NOT_RUN
    invocation: Any = None  # the engine's arguments for it (moesim.engine_args.Invocation), if the engine is named
    no_invocation: str = ""  # why the named engine has no arguments for it (a layout it cannot spell or run)

    @property
    def status(self) -> str:
        if self.row is not None:
            return "ok"
        if not self.configurations:
            return "not swept"
        return "not run" if self.run == 0 else "nothing fits"


@dataclass
class Answer:
    """The deployment answer for one scenario (model, GPU, host, batch, prompt, link)."""

    model: str
    hw: str
    host: str
    batch: int
    prompt_len: int
    link_gbps: float
    goal: str
    families: list[FamilyBest]
    bound: FamilyBest  # the oracle: what perfect prediction would give (never the winner)
    winner: dict[str, Any] | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["families"] = [{**asdict(f), "status": f.status,
                          "configuration": configuration(f.row) if f.row else None} for f in self.families]
        return d


@dataclass
class Crossover:
    """The best ``metric`` of each family along ``axis``, the others held at ``fixed``."""

    model: str
    hw: str
    host: str
    axis: str
    metric: str
    fixed: dict[str, Any]
    xs: list[float]
    curves: dict[str, list[float | None]]  # family -> best value at each x (None: nothing fits)
    winners: list[str | None]  # the winning family at each x
    changes: list[dict[str, Any]] = field(default_factory=list)  # where the winner changes
    #: family -> the 80% range (low, high) of its best TPOT at each x (None: no range); TPOT only
    bands: dict[str, list[list[float] | None]] = field(default_factory=dict)


def _level(value: float) -> float:
    """``value`` to 6 significant digits: two families' sums of the same step times agree
    to rounding only, and a rounding difference is no crossover."""
    return float(f"{value:.6g}")


def _rank(row: dict[str, Any], key: str) -> tuple:
    fam = row["family"]
    return (_level(row[key]), simplicity(fam))


def _best(rows: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    fitting = [r for r in rows if r["fits"] and _ok(r[key])]
    return min(fitting, key=lambda r: _rank(r, key)) if fitting else None


def _reason(winner: dict[str, Any] | None, families: list[FamilyBest], key: str, what: str) -> str:
    if winner is None:
        return ("no configuration of any family fits in memory or runs on this machine (each row's note says "
                "why)")
    others = sorted((f for f in families if f.row is not None and f.family != winner["family"]),
                    key=lambda f: _rank(f.row, key))
    unit = " ms" if key.endswith("_ms") else ""
    head = f"{winner['family']} ({configuration(winner)}) has the {what}, {number(winner[key])}{unit}"
    if others:
        second = others[0].row
        ratio = second[key] / winner[key] if winner[key] > 0 else 1.0 if second[key] <= 0 else float("inf")  # 0 and 0: level
        if ratio < 1.005:
            head += (f", level with {second['family']} ({number(second[key])}{unit}; on a tie the simpler "
                     "deployment is named)")
        elif ratio == float("inf"):  # none against some (bytes moved): no ratio to give
            head += f", against {number(second[key])}{unit} for the next family, {second['family']}"
        else:
            head += (f", {ratio:.2f}x better than the next family, {second['family']} "
                     f"({number(second[key])}{unit})")
    tail = f"; {bound_words(winner)}"
    if key == "tpot_ms" and winner.get("tpot_ms_low") is not None:
        tail += (f"; measurements of such deployments fall within {range_text(winner, 'tpot_ms')} ms "
                 f"({NOMINAL:.0%} range, {winner['range_basis']})")
    absent = [f.family for f in families if f.status == "nothing fits"]
    if absent:
        tail += f"; {', '.join(absent)}: nothing fits in device memory"
    if cannot := [f.family for f in families if f.status == "not run"]:
        tail += f"; {', '.join(cannot)}: {'do' if len(cannot) > 1 else 'does'} not run on this machine (the rows say why)"
    return head + tail


def scenarios(rows: list[dict[str, Any]]) -> list[Scenario]:
    """Every (model, GPU, host, batch, prompt length, link) the rows cover, in sweep order."""
    hosts_of: dict[tuple[str, str], dict[str, None]] = {}
    for r in rows:  # the hosts the CPU families ran on, per (model, GPU): one pass, not one per row
        hosts_of.setdefault((r["base_model"], r["hw"]), {})
        if r["host"] != "-":
            hosts_of[r["base_model"], r["hw"]][r["host"]] = None
    out: dict[Scenario, None] = {}
    for r in rows:
        hosts = [r["host"]] if r["host"] != "-" else list(hosts_of[r["base_model"], r["hw"]]) or ["-"]
        for h in hosts:
            out[(r["base_model"], r["hw"], h, r["batch"], r["prompt_len"], r["link_gbps"])] = None
    return list(out)


def _firsts(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Each (model, GPU)'s first batch, prompt length and link in the sweep: the link is each
    machine's own unless one was given, so one first value for all left the others out."""
    firsts: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        firsts.setdefault((r["base_model"], r["hw"]), {a: r[a] for a in AXES})
    return firsts


def base_scenarios(rows: list[dict[str, Any]]) -> list[Scenario]:
    """One scenario per (model, GPU, host): batch, prompt length and link at their first
    values for that model and GPU (the crossovers show what changes along each)."""
    firsts = _firsts(rows)
    first = {key: tuple(f[a] for a in ("batch", "prompt_len", "link_gbps")) for key, f in firsts.items()}
    return [s for s in scenarios(rows) if s[3:] == first[s[0], s[1]]]


def _in(rows: list[dict[str, Any]], model: str, hw: str, host: str, **fixed: Any) -> list[dict[str, Any]]:
    return [r for r in rows if r["base_model"] == model and r["hw"] == hw and r["host"] in (host, "-")
            and all(r[a] == v for a, v in fixed.items())]


@dataclass(frozen=True)
class Timed:
    """The machines and models a sweep's rows were timed on, by the names the rows carry:
    a user's GPU file or a GGUF's model is what its row ran, never a built-in or catalogue
    entry of the same name (:meth:`of` a :class:`moesim.sim.sweep.Sweep`)."""

    machines: dict[str, Machine]
    specs: dict[str, ModelSpec]
    hosts: dict[str, HostProfile] = field(default_factory=dict)
    #: The context the user will serve (``--ctx``): the printed commands' ``-c`` /
    #: ``--max-model-len`` and the memory it needs; None leaves the engine's default (never
    #: the timed prompt: a server started at a 384-token context refuses the user's first
    #: long prompt).
    context: int | None = None

    @classmethod
    def of(cls, sweep, context: int | None = None) -> Timed:
        hosts = {}
        for name in sweep.hosts:
            for m in sweep.hws:
                with contextlib.suppress(MoesimError):  # a machine without a host: its rows say so already
                    h = sweep.host_profile(name, m.gpus[0] if m.gpus else None)
                    hosts[h.name] = h
        return cls({m.name: m for m in sweep.hws}, {t.model.name: t.model for t in sweep.traces.values()}, hosts,
                   context)

    def machine(self, row: dict[str, Any]) -> Machine:
        return self.machines[row["hw"]] if row["hw"] in self.machines else get_machine(row["hw"])

    def spec(self, row: dict[str, Any]) -> ModelSpec:
        base = row["base_model"]
        return self.specs[base] if base in self.specs else model_named(base)


#: Rows of no known sweep: their names resolved as built-in and catalogue names.
BY_NAME = Timed({}, {})


def row_layout(row: dict[str, Any], timed: Timed = BY_NAME):
    """(spec, :class:`moesim.layout.Layout`) a what-if row of a static layout ran (on
    ``timed``'s machine and model): what an engine's arguments spell. None for a row that
    copies experts (no engine argument places a cache)."""
    counts = of_row(row).row_knobs(row)  # the family's own knobs
    if counts is None or None in counts.values():
        return None
    spec = store_as(timed.spec(row), row["expert_dtype"])
    machine = timed.machine(row)
    if "resident_experts" in counts:  # the same count of GPU experts in every layer (KTransformers' --kt-num-gpu-experts)
        hot = np.zeros((spec.n_moe_layers, spec.n_experts), bool)
        hot[:, :counts["resident_experts"] // spec.n_moe_layers] = True
        return spec, make_layout(spec, machine.n_gpus, hot=hot, source=row["placement"])
    # The function the simulator laid the row out with (layers cut by their bytes over several
    # GPUs), so that the arguments spell the deployment that was timed, not a re-derived one.
    shares, split = row.get("tensor_split", "-"), row.get("split", "-")
    setting = Setting(split=split if split in SPLITS else "layer",  # "-": one GPU or none
                      ratios=None if shares in ("-", None) else [float(x) for x in str(shares).split(",")], **counts)
    return spec, layout_for(of_row(row), spec, machine, setting, batch=int(row["batch"]),
                            context=int(row["prompt_len"]) + int(row["tokens"]))


def invocation_of(row: dict[str, Any], engine: str, timed: Timed = BY_NAME):
    """(the ``engine``'s arguments for a row, or None; why None where the engine cannot run
    the row's layout: "" where the row places no layout an engine argument can spell)."""
    found = row_layout(row, timed)
    if found is None:
        return None, ""
    if engine not in FORMATTERS:  # SGLang, a user's engine, PyTorch eager: said, not left blank
        if engine == DEFAULT_ENGINE:
            return None, (f"{DEFAULT_ENGINE} is moesim's own reference executor (`moesim profile` runs it), not an "
                          "engine with a command line")
        # A built-in engine (or a user's file whose runs_as names one) needs no runs_as advice: only a
        # user's engine without one does.
        advice = "" if engine.lower() in builtin_engines() else (
            " (a user's engine file says which of them it runs with runs_as = \"llama.cpp\", or another)")
        return None, f"moesim writes the arguments of {', '.join(FORMATTERS)}, not {engine}'s{advice}"
    spec, layout = found
    kw: dict[str, Any] = {}
    hot = of_row(row).row_knobs(row).get("resident_experts")  # a hot set: the same count a layer
    if hot is not None:
        kw["gpu_experts_per_layer"] = hot // spec.n_moe_layers
    given = model_file(row["base_model"])  # the user's own file: what the arguments load, not a placeholder
    held = timed.spec(row).expert_dtype
    converted = given is not None and row["expert_dtype"] != held  # a plan in a format the file does not hold
    if given is not None and not converted:
        if given.suffix == ".gguf":
            if engine in ("llama.cpp", "ik_llama.cpp"):
                kw["model_path"] = str(given)
        elif engine in ("vllm", "ktransformers"):
            kw["model_path"] = str(given.parent)  # the checkpoint folder its config.json is in
    try:
        host, threads = timed.hosts.get(row["host"]), row.get("threads")
        numa = host is not None and isinstance(threads, int) and host.sockets > 1 and threads > host.cores
        prompt, steps = int(row["prompt_len"]), int(row["tokens"])
        inv = invocation(engine, spec, layout, threads=threads, tokens=steps, context=timed.context,
                         batch=int(row["batch"]), numa=numa, **kw)
    except MoesimError as e:
        return None, str(e)
    notes = [inv.note] if inv is not None and inv.note else []
    if inv is not None and engine in ("llama.cpp", "ik_llama.cpp", "vllm"):  # the engines whose context moesim spells
        notes.append(f"the context is the {timed.context:,} tokens of --ctx" if timed.context
                     else f"the context is {engine}'s default (moesim timed a {prompt}-token prompt and {steps} decode "
                          "steps; --ctx N prints the context you will serve and the memory it needs)")
    extra = hot % spec.n_moe_layers if hot is not None else 0
    if extra:
        notes.append(f"--kt-num-gpu-experts is one count for every layer: the plan's {extra} experts beyond "
                     f"{kw['gpu_experts_per_layer']} a layer stay on the CPU")
    if converted:
        notes.append(f"the plan's experts are {row['expert_dtype']}, and {given.name} holds {held}: the arguments name "
                     f"a placeholder for a copy of the model in {row['expert_dtype']}, not that file")
    if inv is not None:
        notes.append(memory_words(spec, layout, timed.machine(row), int(row["batch"]), timed.context or prompt + steps))
    if inv is not None and notes:
        inv = replace(inv, note="; ".join(notes))
    return inv, ""


#: The longest context :func:`largest_context` looks for (tokens): beyond any model's window.
CONTEXT_CAP = 1 << 24


def largest_context(spec: ModelSpec, layout, mem: list[float], batch: int) -> int:
    """The most tokens of context whose KV cache still fits every GPU of ``layout`` beside its
    weights and compute buffers (``mem``: each GPU's bytes), by bisection (a layout's bytes grow
    with the context: a sliding or linear layer's stop growing at its window); 0 when even
    the weights do not fit, :data:`CONTEXT_CAP` when no context fills it."""
    def fits(ctx: int) -> bool:
        return all(b <= m for b, m in zip(layout_bytes(spec, layout, batch, ctx).gpu, mem))

    if not fits(0):
        return 0
    if fits(CONTEXT_CAP):
        return CONTEXT_CAP
    lo, hi = 0, CONTEXT_CAP
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def memory_words(spec: ModelSpec, layout, machine: Machine, batch: int, context: int) -> str:
    """What the deployment needs on each device before a user loads it (what llama.cpp users
    find out by trial loads): each GPU's weights, its KV cache at ``context``, the engine's
    compute buffers (:data:`moesim.memory.WORKSPACE_BYTES`, an estimate), against its memory;
    the host's weights and KV cache; and the largest context that fits with this placement."""
    mem = [x * 1e9 for x in machine.device_memory_gb()]
    empty, full = layout_bytes(spec, layout, batch, 0), layout_bytes(spec, layout, batch, context)
    parts = []
    for i, (g, at) in enumerate(zip(empty.gpu, full.gpu)):
        who = machine.gpus[i].name + (f" {i}" if len(mem) > 1 else "")
        parts.append(f"{who} {number(at / 1e9, 3)} of {number(mem[i] / 1e9, 3)} GB (weights "
                     f"{number((g - WORKSPACE_BYTES) / 1e9, 3)}, KV cache {number((at - g) / 1e9, 3)} at "
                     f"{context:,} tokens, compute buffers {number(WORKSPACE_BYTES / 1e9, 3)}, an estimate)")
    host = full.host_weights + full.host_kv
    words = "memory: " + "; ".join(parts + ([f"host {number(host / 1e9, 3)} GB"] if host else []))
    if mem:
        ctx = largest_context(spec, layout, mem, batch)
        words += ("; even the weights do not fit" if ctx == 0 else
                  f"; a {context:,}-token context does not fit this placement: at most {ctx:,} tokens"
                  if ctx < context else
                  f"; the largest context that fits this placement: {ctx:,} tokens" if ctx < CONTEXT_CAP else
                  "; any context fits this placement")
    return words


def deployment_answer(rows: list[dict[str, Any]], goal: str = "tpot",
                      which: list[Scenario] | None = None, engine: str | None = None,
                      timed: Timed = BY_NAME) -> list[Answer]:
    """Per scenario (default: :func:`base_scenarios`), each family's best fitting
    configuration for ``goal`` and the overall winner with the reason in words; with
    ``engine``, each best configuration's arguments for it (:mod:`moesim.engine_args`), for
    the machines and models the rows were ``timed`` on."""
    if goal not in GOALS:
        raise MoesimError(f"unknown goal {goal!r}; known: {', '.join(GOALS)}")
    key, what = GOALS[goal]
    answers = []
    for model, hw, host, batch, prompt, link in (base_scenarios(rows) if which is None else which):
        here = _in(rows, model, hw, host, batch=batch, prompt_len=prompt, link_gbps=link)
        fams = []
        for fam in (*policy_families(), BOUND):
            mine = [r for r in here if r["family"] == fam]
            top = _best(mine, key)
            inv, why = invocation_of(top, engine, timed) if engine and top is not None and fam != BOUND else (None, "")
            fams.append(FamilyBest(fam, top, len(mine), sum(bool(r["fits"]) for r in mine), invocation=inv,
                                   no_invocation=why,
                                   run=sum(r["bound"] != NOT_RUN for r in mine)))
        bound, fams = fams[-1], fams[:-1]
        ranked = [f.row for f in fams if f.row is not None]
        winner = min(ranked, key=lambda r: _rank(r, key)) if ranked else None
        answers.append(Answer(model, hw, host, batch, prompt, link, goal, fams, bound, winner,
                              _reason(winner, fams, key, what)))
    return answers


def crossovers(rows: list[dict[str, Any]], metrics: dict[str, tuple[str, ...]] | None = None) -> list[Crossover]:
    """Along each swept axis (batch size, prompt length, link bandwidth; one with at least
    two values), the best value of each family for each metric, the others held at their
    first values; ``changes`` lists where the winning family changes, with the point where
    the two families' curves cross, interpolated linearly in log(x) (an estimate between
    two simulated points). Default metrics: TPOT on every axis, TTFT too on prompt length."""
    metrics = metrics or {"batch": ("tpot_ms",), "prompt_len": ("tpot_ms", "ttft_ms"), "link_gbps": ("tpot_ms",)}
    firsts = _firsts(rows)
    out = []
    for model, hw, host, *_ in base_scenarios(rows):
        mine = _in(rows, model, hw, host)
        first = firsts[model, hw]
        for axis, keys in metrics.items():
            xs = sorted({r[axis] for r in mine})
            if len(xs) < 2:
                continue
            fixed = {a: v for a, v in first.items() if a != axis}
            line = [r for r in mine if all(r[a] == v for a, v in fixed.items())]
            for key in keys:
                curves: dict[str, list[float | None]] = {}
                bands: dict[str, list[list[float] | None]] = {}
                for fam in (*policy_families(), BOUND):
                    pts = [_best([r for r in line if r["family"] == fam and r[axis] == x], key) for x in xs]
                    if any(p is not None for p in pts):
                        curves[fam] = [p[key] if p is not None else None for p in pts]
                        if key == "tpot_ms":  # each point's range (moesim.sim.intervals), as the rows carry it
                            bands[fam] = [[p["tpot_ms_low"], p["tpot_ms_high"]] if p is not None
                                          and p.get("tpot_ms_low") is not None else None for p in pts]
                winners = []
                for i in range(len(xs)):
                    cand = {f: c[i] for f, c in curves.items() if f != BOUND and c[i] is not None}
                    winners.append(min(cand, key=lambda f: (_level(cand[f]), simplicity(f))) if cand else None)
                changes = []
                for i in range(1, len(xs)):
                    a, b = winners[i - 1], winners[i]
                    if a != b and a is not None and b is not None:
                        changes.append({"from": a, "to": b, "after": xs[i - 1], "by": xs[i],
                                        "near": _cross(xs[i - 1], xs[i], curves[a], curves[b], i)})
                out.append(Crossover(model, hw, host, axis, key, fixed, xs, curves, winners, changes, bands))
    return out


def _cross(x0: float, x1: float, a: list, b: list, i: int) -> float | None:
    """Where curves ``a`` and ``b`` cross between points i-1 and i (log-x linear), if both are there."""
    if None in (a[i - 1], a[i], b[i - 1], b[i]) or x0 <= 0:
        return None
    d0, d1 = a[i - 1] - b[i - 1], a[i] - b[i]
    if d0 == d1:
        return None
    f = d0 / (d0 - d1)
    return float(math.exp(math.log(x0) + min(max(f, 0.0), 1.0) * (math.log(x1) - math.log(x0))))


def describe_change(c: Crossover, ch: dict[str, Any]) -> str:
    """One line: where along ``c.axis`` the winner changes."""
    near = f" (curves cross near {number(ch['near'])})" if ch["near"] is not None else ""
    metric = "TPOT" if c.metric == "tpot_ms" else "TTFT" if c.metric == "ttft_ms" else c.metric
    return (f"{c.model} on {c.hw}{'' if c.host == '-' else ' + ' + c.host}, {metric} against {AXES[c.axis]}: "
            f"{ch['from']} wins at {number(ch['after'])}, {ch['to']} at {number(ch['by'])}{near}")


COLS = (("family", 16), ("configuration", 30), ("TPOT ms", 8), ("TTFT ms", 9), ("bound", 11))


def format_answer(a: Answer, width: int = 80) -> str:
    """The answer as plain text no wider than ``width`` (80: a terminal): a line of
    scenario, a table of families (the configuration wraps), the winner and why."""
    host = "" if a.host == "-" else f" + {a.host}"
    lines = textwrap.wrap(f"{a.model} on {a.hw}{host}, batch {a.batch}, prompt {a.prompt_len}, "
                          f"{fmt.link(a.link_gbps)} (best by {a.goal}):", width)
    cols = [(n, w) for n, w in COLS]
    lines.append(" ".join(f"{n:<{w}}" if i in (0, 1, 4) else f"{n:>{w}}" for i, (n, w) in enumerate(cols)).rstrip())
    for f in (*a.families, a.bound):
        r = f.row
        if r is None:
            lines.append(f"{f.family:<{cols[0][1]}} {f.status}")
            continue
        conf = textwrap.wrap(configuration(r), cols[1][1]) or [""]
        ttft = f"{number(r['ttft_ms'], 4)}" if _ok(r["ttft_ms"]) else "-"
        (_, fw), (_, cw) = cols[0], cols[1]
        lines.append(f"{f.family:<{fw}} {conf[0]:<{cw}} {number(r['tpot_ms'], 4):>8} {ttft:>9} {r['bound']:<11}".rstrip())
        lines += [f"{'':<{fw}} {c}" for c in conf[1:]]
    lines += textwrap.wrap(("winner: " if a.winner else "") + a.reason, width)
    spelled: dict[tuple, str] = {}  # the same arguments (a cpu-static of 0 layers is all-resident) print once
    for f in a.families:
        if f.no_invocation:
            lines += textwrap.wrap(f"{f.family} with {f.row['engine']}: no command: {f.no_invocation}",
                                   width)
        if f.invocation is not None:
            tps = f.row["tokens_per_s"]
            key = (f.invocation.engine, tuple(f.invocation.args), tuple(f.invocation.files.items()))
            if key in spelled:
                lines.append(f"{f.family} with {f.invocation.engine}: the same arguments as {spelled[key]}")
                continue
            spelled[key] = f.family
            rng = range_text(f.row)
            rng = "" if rng == "-" else f", {NOMINAL:.0%} range {rng}"
            who = f.invocation.engine if f.row["engine"] == f.invocation.engine else \
                f"{f.row['engine']} (runs as {f.invocation.engine})"
            lines.append(f"{f.family} with {who} ({number(tps)} tokens/s predicted{rng}):")
            lines.append(f"  {f.invocation.line()}")
            if f.invocation.note:
                lines += textwrap.wrap(f.invocation.note, width, initial_indent="  ", subsequent_indent="  ")
            for name, text in f.invocation.files.items():
                lines.append(f"  {name}:")
                lines += [f"    {t}" for t in text.rstrip().splitlines()]
    return "\n".join(lines)


def lighter_but_slower(rows: list[dict[str, Any]], engine, timed: Timed = BY_NAME) -> list[str]:
    """Why a file type with fewer bytes a weight is predicted slower than one with more, where
    a sweep over ``--expert-dtype`` shows it (each family's best row per format on one model,
    machine and host): the engine's kernels for the lighter format reach less of the memory's
    rate (its ``cpu_weight_efficiency`` / ``gpu_weight_efficiency`` figures, said with their
    kind), so its smaller reads take longer. One line a pair of formats."""
    best_of: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if not r.get("fits") or not isinstance(r.get("tpot_ms"), (int, float)):
            continue
        per = best_of.setdefault((r["base_model"], r["hw"], r["host"], r["family"]), {})
        if r["expert_dtype"] not in per or r["tpot_ms"] < per[r["expert_dtype"]]["tpot_ms"]:
            per[r["expert_dtype"]] = r
    notes: dict[tuple[str, str], str] = {}
    for per in best_of.values():
        if len(per) < 2:
            continue
        stored = {d: store_as(timed.spec(r), d) for d, r in per.items()}
        bits = {d: s.expert_bytes * 8 / s.expert_params for d, s in stored.items()}
        for light in per:
            for heavy in per:
                a, b = per[light], per[heavy]
                if bits[light] >= bits[heavy] or a["tpot_ms"] <= b["tpot_ms"] * 1.02 or (light, heavy) in notes:
                    continue
                where = "cpu" if a["bound"] == "CPU compute" else "gpu"
                table = getattr(engine, f"{where}_weight_efficiency")
                eff = {d: (engine.weight_efficiency(where, stored[d].expert_dtype),
                           table.get(stored[d].expert_dtype) or table.get("default")) for d in (light, heavy)}
                said = {d: f"{number(e, 2)}" + (f" ({f.kind})" if f is not None else "") for d, (e, f) in eff.items()}
                why = (f"{engine.name}'s {where.upper()} kernels for {light} reach {said[light]} of the memory's rate, "
                       f"for {heavy} {said[heavy]}" if eff[light][0] < eff[heavy][0] else
                       f"its {a['bound']} bound is not the bytes read ({engine.name}'s {where.upper()} kernels reach "
                       f"{said[light]} and {said[heavy]} of the memory's rate)")
                notes[(light, heavy)] = (
                    f"{light} ({number(bits[light], 3)} bits a weight) is predicted slower than {heavy} "
                    f"({number(bits[heavy], 3)}): {number(a['tpot_ms'], 3)} against {number(b['tpot_ms'], 3)} ms/token "
                    f"({a['family']} on {a['hw']}): {why}")
    return list(notes.values())
