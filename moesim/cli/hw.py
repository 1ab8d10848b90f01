"""``moesim hw``: hardware profiles with the source of every figure. Python: ``moesim.hardware.get_profile(name)``."""

from __future__ import annotations

from typing import Annotated

import typer

from moesim.cli.app import AsCsv, AsJson, app, out, print_csv, print_json, table
from moesim.engines import DEFAULT_ENGINE, builtin_engines, get_engine, unit_of
from moesim.errors import MoesimError
from moesim.fmt import number
from moesim.hardware import (
    DEFAULT_PROFILE,
    FIGURES,
    HOST_FIGURES,
    THIS_HOST,
    builtin_hosts,
    builtin_profiles,
    get_host,
    get_profile,
    this_machine,
)


@app.command()
def hw(
    profile: Annotated[str | None, typer.Argument(help="A built-in profile name or a .toml path; all if omitted.")] = None,
    as_json: AsJson = False,
    as_csv: AsCsv = False,
    hosts: Annotated[bool, typer.Option("--hosts", help="Host (CPU) profiles instead of GPU profiles.")] = False,
    engines: Annotated[bool, typer.Option("--engines", help="Engine profiles (llama.cpp, KTransformers, vLLM, "
                                                            "PyTorch eager) instead of GPU profiles.")] = False,
) -> None:
    """List hardware profiles, or show one with the kind and source of every figure.

    Profiles are TOML files (docs/hwprofile-format.md); any command's `--hw` also takes
    the path of your own. Host profiles (the CPU that computes experts in the CPU-compute
    policies) are listed with `--hosts`, engine profiles (the software: kernel counts,
    launch costs, the bandwidth its kernels reach per weight format; docs/engine-format.md)
    with `--engines`. Examples: `moesim hw`, `moesim hw gh200`, `moesim hw h100-sxm --json`,
    `moesim hw --hosts`, `moesim hw xeon-8480 --hosts`, `moesim hw --engines`,
    `moesim hw llama.cpp --engines`.
    """
    if hosts and engines:
        raise MoesimError("--hosts and --engines list different profiles: give one")
    if engines:
        _engines(profile, as_json, as_csv)
        return

    if hosts:
        found = [get_host(profile)] if profile else [get_host(n) for n in builtin_hosts()]
        if as_json:
            print_json([{"name": h.name, "description": h.description, "figures": {k: vars(f) for k, f in
                                                                                  h.figures.items()}} for h in found])
        elif as_csv:
            print_csv([{"name": h.name, **{k: f.value for k, f in h.figures.items()}, "description": h.description}
                       for h in found])
        elif profile:
            h = found[0]
            out.print(table(f"{h.name}: {h.description}", ("figure", "value", "unit", "kind", "source"),
                            [[k, f"{f.value:g}", HOST_FIGURES[k][0], f.kind, f.source] for k, f in h.figures.items()]))
        else:
            out.print(table("Host profiles (show one with `moesim hw NAME --hosts` for sources)",
                            ("name", "cores", "DRAM GB/s (achievable)", "bf16 TFLOP/s", "AMX", "description"),
                            [[h.name, f"{h['cores']:g}", f"{h['mem_bw_achievable_gbs']:g}", f"{number(h.flops('bf16') / 1e12)}",
                              "yes" if h.has_amx else "no", h.description] for h in found]))
        return
    if profile:  # `this`: every GPU NVML sees on this machine, each with the source of every figure
        gpus = this_machine().gpus if profile.strip().lower() == THIS_HOST else (get_profile(profile),)
        docs = [{"name": p.name, "description": p.description, "link": p.link,
                 "figures": {k: vars(f) for k, f in p.figures.items()}} for p in gpus]
        if as_json:
            print_json(docs[0] if len(docs) == 1 else docs)
        elif as_csv:
            print_csv([{**({"gpu": p.name} if len(gpus) > 1 else {}), "figure": k, "unit": FIGURES[k][0], **vars(f)}
                       for p in gpus for k, f in p.figures.items()])
        else:
            for p in gpus:
                out.print(table(f"{p.name}: {p.description} (link: {p.link})",
                                ("figure", "value", "unit", "kind", "source"),
                                [[k, f"{f.value:g}", FIGURES[k][0], f.kind, f.source] for k, f in p.figures.items()]))
        return
    profiles = [get_profile(n) for n in builtin_profiles()]
    listing = [{"name": p.name, "link": p.link, **{k: f.value for k, f in p.figures.items()},
                "description": p.description} for p in profiles]
    if as_json or as_csv:
        print_json(listing) if as_json else print_csv(listing)
        return
    out.print(table(f"Hardware profiles (show one with `moesim hw NAME` for sources; default: {DEFAULT_PROFILE})",
                    ("name", "link", "device GB", "HBM GB/s (achievable)", "bf16 TFLOP/s", "H2D pinned GB/s",
                     "latency us", "description"),
                    [[p.name, p.link, f"{p['device_memory_gb']:g}", f"{p['mem_bw_achievable_gbs']:g}",
                      f"{p['bf16_tflops']:g}", f"{p['h2d_pinned_gbs']:g}", f"{p['transfer_latency_us']:g}",
                      p.description] for p in profiles]))


def _engines(name: str | None, as_json: bool, as_csv: bool) -> None:

    found = [get_engine(name)] if name else [get_engine(n) for n in builtin_engines()]
    if as_json:
        print_json([{"name": e.name, "description": e.description, "runs_on": list(e.runs_on),
                     "figures": {k: vars(f) for k, f in e.sources()},
                     "builds": [{"before": day, "figures": {k: vars(f) for k, f in figs.items()}}
                                for day, figs in e.before]} for e in found])
    elif as_csv:
        print_csv([{"engine": e.name, "figure": k, **vars(f)} for e in found for k, f in e.sources()])
    elif name:
        e = found[0]
        out.print(table(f"{e.name}: {e.description} (runs on {', '.join(e.runs_on)})",
                        ("figure", "value", "unit", "kind", "source"),
                        [[k, number(f.value, 4), unit_of(k), f.kind, f.source] for k, f in e.sources()]))
        _builds(e)
    else:
        out.print(table(f"Engine profiles (show one with `moesim hw NAME --engines` for sources; default: "
                        f"{DEFAULT_ENGINE})", ("name", "runs on", "fitted figures", "description"),
                        [[e.name, ", ".join(e.runs_on), str(sum(f.kind == "fitted" for _, f in e.sources())),
                          e.description] for e in found]))


def _builds(e) -> None:
    """The builds ``--engine NAME@DATE`` chooses between: each ``[[before]]`` entry's date and the
    figures builds before it had (the newest build, the default, has the figures above)."""
    if not e.before:
        out.print(f"builds: {e.name} has one set of figures for every build (no [[before]] entries)", markup=False)
        return
    out.print(table(f"{e.name}'s builds: --engine {e.name}@YYYY-MM-DD prices a build from that date (newest first; "
                    "a build before a date has that row's figures, and every older row's too)",
                    ("before", "figure", "value", "source"),
                    [[day, k, number(f.value, 4), f.source] for day, figs in e.before for k, f in figs.items()]))
