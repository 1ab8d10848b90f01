"""Commands whose options are a dataclass's fields (:func:`command_of`), and the deployment
options ``moesim replay`` and ``moesim whatif`` share: one help text each.

``whatif`` takes comma-separated lists where ``replay`` takes one value; the words say
so once, here."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import typer

from moesim.atomic import exclusive
from moesim.cli.app import app
from moesim.errors import MoesimError
from moesim.hardware import given_path
from moesim.inputs import TOML_CAP, check_input
from moesim.setting import HostKnobs
from moesim.stop import ignore_further

A = TypeVar("A")


def command_of(args: type[A], name: str | None = None) -> Callable[[Callable[[A], None]], Callable[..., None]]:
    """Register ``handler(a: args)`` as a ``moesim`` command whose options are the fields of the
    dataclass ``args``, in their order (typer reads a function's parameters; it is given one
    whose signature is the fields'). The handler takes one typed object, not dozens of
    parameters: Vidur's config dataclasses flattened into its command line are the model.
    A field's annotation carries its ``typer.Option``/``typer.Argument``, as a parameter's did."""
    hints = typing.get_type_hints(args, include_extras=True)  # the module's names resolve the string annotations
    own = vars(args).get("__annotations__", {})  # its own options first, then those it inherits (with defaults)
    fields = sorted(dataclasses.fields(args), key=lambda f: f.name not in own)
    params = [inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=hints[f.name],
                                default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default)
              for f in fields]

    def register(handler: Callable[[A], None]) -> Callable[..., None]:
        @functools.wraps(handler)
        def command(**values: Any) -> None:
            return handler(args(**values))

        del command.__wrapped__  # typer would read the handler's one parameter through it
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return app.command(name)(command)

    return register


ENGINES = "llama.cpp, ik_llama.cpp, ktransformers, vllm, sglang, moe-infinity, mixtral-offloading, pytorch-eager (default)"


def _profile_files(what: str):
    """A callback: every item of the option that names a file is looked at (not read) as the
    reader will (moesim.inputs): a device, socket or folder, or a name too long, is one line
    at once, even where the run would not read it (``--host`` under a GPU-only policy)."""
    def check(value: str | None) -> str | None:
        if value:
            for item in value.split(","):
                p = given_path(item.strip(), what) if item.strip() else None
                if p is not None and not p.is_dir():
                    check_input(p, what, TOML_CAP)
        return value
    return check


ENGINE_HELP = f"The inference engine whose figures time the work: {ENGINES} or a .toml (`moesim hw --engines`)."
Engine = Annotated[str | None, typer.Option(callback=_profile_files("engine profile"), help=ENGINE_HELP)]
EngineAxis = Annotated[str | None, typer.Option("--engine", callback=_profile_files("engine profile"),
                                              help=ENGINE_HELP + " Comma-separated: an axis.")]
SplitMode = Annotated[str, typer.Option("--split", help="Several GPUs: layer (whole layers per GPU, llama.cpp's "
                                                      "default) or tensor (every layer split over all).")]
TensorSplit = Annotated[str | None, typer.Option(help="Several GPUs, layer split: comma-separated shares of the layers "
                                                      "per GPU (llama.cpp --tensor-split; default: cut by bytes).")]
Threads = Annotated[int | None, typer.Option(help="CPU threads the engine uses (default: every core of the host).")]
Amx = Annotated[bool, typer.Option("--amx/--no-amx", help="CPU-compute policies: use the host's AMX rate if any.")]


@dataclass(kw_only=True)
class HostOptions:
    """:class:`moesim.setting.HostKnobs` as replay and whatif take them: declared once, inherited."""

    threads: Threads = None
    amx: Amx = True
    host_knobs = HostKnobs.host_knobs  # the knobs by name, as the setting and the sweep hand them over


GpuLayers = Annotated[str, typer.Option(help="gpu-layers: model layers on the GPU(s) (llama.cpp -ngl), or auto (the "
                                             "most that fit); whatif: comma-separated.")]
OffloadGib = Annotated[str, typer.Option(help="weight-streaming: GiB of the first layers' weights kept in host memory "
                                              "and read over the link every step (vLLM --cpu-offload-gb), or auto "
                                              "(the least that fits); whatif: comma-separated.")]
CachePerLayer = Annotated[bool, typer.Option("--cache-per-layer", help="Copy policies: the cache size is each MoE "
                                             "layer's (one cache per layer, as mixtral-offloading), not one for all.")]
Host = Annotated[str | None, typer.Option(callback=_profile_files("host profile"), help="CPU-compute policies and --hw none: host profile name or .toml "
                                               "(default: the GPU profile's host; `moesim hw --hosts`); whatif: "
                                               "comma-separated.")]


def one(values: list, option: str):
    """The one value of an option ``replay`` takes once (``whatif`` sweeps several)."""
    if len(values) != 1:
        raise MoesimError(f"{option}: one value (auto or a number); moesim whatif sweeps several")
    return values[0]


def torch_threads(value: int) -> int:
    """``--threads`` of a command that runs torch (a typer callback): 1 to 4 a CPU of this
    machine. 0 or -1 was torch's RuntimeError; 9999 failed creating threads, or ran out of memory."""
    most = 4 * (os.cpu_count() or 1)
    if not 1 <= value <= most:
        raise MoesimError(f"--threads {value}: torch threads, 1 to {most} (4 a CPU of this machine)")
    return value


@contextmanager
def ends_on_interrupt() -> Iterator[None]:
    """The first Ctrl-C, SIGTERM or SIGHUP ends the run (the library stops its workers on the way
    out); from then on further ones are ignored, so a second one 0.3 s later cannot cut
    the exit short (interpreter shutdown takes a moment) and end it in a traceback."""
    try:
        yield
    except KeyboardInterrupt:
        ignore_further()
        raise


def holding(path, what: str):
    """``path``'s lock while within (:func:`moesim.atomic.exclusive`); nothing for None."""


    return nullcontext() if path is None else exclusive(path, what)


def given_options(ctx: typer.Context) -> set[str]:
    """The options the user typed (``--skew``, ...), as click records each value's source
    (by name: typer >= 0.20 vendors its own click): a note that an option changed nothing
    names what was given, never a value compared against a copy of its default."""
    source = ctx.get_parameter_source
    return {p.opts[0] for p in ctx.command.params
            if p.opts and p.opts[0].startswith("--") and getattr(source(p.name), "name", None) == "COMMANDLINE"}
