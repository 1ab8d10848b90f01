"""The command-line arguments that run a deployment on the engine the user names.

moesim's answer is a layout (:class:`moesim.layout.Layout`: which processor holds every
layer and expert), a thread count and a context; each engine spells that its own way.
One function per engine turns an answer into its arguments, so a new engine joins here:

- llama.cpp / ik_llama.cpp (``llama-server``, ``llama-cli``): ``-ngl`` (the last N layers
  on the GPUs, the head with them when N covers every layer), ``--n-cpu-moe N`` (the
  expert tensors of the first N model layers stay on the CPU; ``--cpu-moe`` for all),
  ``--tensor-split`` and ``--split-mode`` across GPUs, ``-t``, ``-c`` (llama.cpp's
  ``common/arg.cpp`` defines them); ``program="llama-bench"`` spells the same deployment
  for ``llama-bench`` (:func:`llama_bench_args`: its own spellings of the few flags that
  differ);
- KTransformers: an optimize-rule YAML that keeps the chosen layers' experts on the CPU
  (its ``optimize_rules`` format: a ``match`` regex on module names and a ``replace``
  class) and ``--cpu_infer`` for ``ktransformers.local_chat``; GPU experts per layer with
  its SGLang integration's ``sglang.launch_server --kt-num-gpu-experts --kt-cpuinfer``;
- vLLM: ``--tensor-parallel-size`` or ``--pipeline-parallel-size`` (with
  ``VLLM_PP_LAYER_PARTITION``), ``--cpu-offload-gb``, ``--max-model-len``.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass

from moesim.errors import MoesimError
from moesim.layout import CPU, Layout
from moesim.models import ModelSpec


@dataclass(frozen=True)
class Invocation:
    """An engine's command for one deployment: the arguments, and a file some engines need."""

    engine: str
    args: list[str]
    files: dict[str, str]  # name -> text (KTransformers' optimize rule)
    note: str = ""

    def line(self) -> str:
        """The command as a shell reads it back (shlex: a path with a space, a regex's
        ``|``, ``*`` or ``\\`` quoted, so that the shell passes it unchanged)."""
        return shlex.join(self.args)


def _ranges(layers: list[int]) -> str:
    """``0|1|2`` alternation of layer indices for a regex."""
    return "|".join(str(i) for i in layers)


def llama_cpp(spec: ModelSpec, layout: Layout, *, threads: int | None = None, context: int | None = None,
              model_path: str = "MODEL.gguf", ratios: list[float] | None = None, program: str = "llama-server",
              batch: int = 1, numa: bool = False, **_: object) -> Invocation:
    """llama.cpp's arguments for ``layout`` (see the module docstring); ``batch`` sequences at
    once are llama-server's slots (``-np``), and ``-c`` is the context of them all (the KV
    cache it allocates is shared by its slots), as the row was timed and fitted; ``numa``: the
    threads span several sockets, whose memory llama.cpp reads as ``--numa distribute`` places
    it (the engine profile's ``numa_efficiency`` is that mode's)."""
    if layout.n_resident and (layout.expert_device >= 0).any() and not _whole_layers(layout):
        raise MoesimError("llama.cpp places experts a whole layer at a time (one tensor per layer): it cannot hold "
                          "a per-expert hot set; use cpu-static or KTransformers")
    L = spec.n_layers
    g = layout.gpu_layers()
    args = [program, "-m", model_path, "-ngl", str(99 if g == L else g)]
    cpu_moe = layout.cpu_moe_layers()
    gpu_moe = [m for m in range(spec.n_moe_layers) if layout.layer_device[spec.moe_layers[m]] != CPU]
    on_cpu_of_gpu_layers = [m for m in gpu_moe if (layout.expert_device[m] == CPU).all()]
    note = ""
    if on_cpu_of_gpu_layers:
        n_model = spec.moe_layers[max(on_cpu_of_gpu_layers)] + 1  # --n-cpu-moe counts model layers from 0
        args += ["--cpu-moe"] if cpu_moe == spec.n_moe_layers else ["--n-cpu-moe", str(n_model)]
        note = (f"the same placement for builds without --n-cpu-moe: -ot '{cpu_moe_override(spec, layout)}' "
                "(the routed experts' tensors of those layers in host memory)")
    if layout.n_gpus > 1:
        if layout.split == "tensor":
            args += ["--split-mode", "row"]
        # llama.cpp splits layers (or, with --split-mode row, each layer's rows) in these
        # proportions; a tensor split shards every layer evenly, as the cost model does.
        shares = ratios or ([1] * layout.n_gpus if layout.split == "tensor" else layout.layers_per_gpu)
        args += ["--tensor-split", ",".join(f"{r:g}" for r in shares)]
    uses_cpu = (layout.layer_device == CPU).any() or (layout.expert_device == CPU).any()
    if threads and uses_cpu:
        args += ["-t", str(threads)]
    if numa and uses_cpu:
        args += ["--numa", "distribute"]
    if batch > 1 and program != "llama-bench":
        args += ["-np", str(batch)]
    if context:
        args += ["-c", str(context * (batch if program != "llama-bench" else 1))]
    if program == "llama-bench":
        args, dropped = llama_bench_args(args, spec.n_layers)
        note = "; ".join(x for x in (note, *dropped) if x)
    return Invocation("llama.cpp", args, {}, note)


def cpu_moe_override(spec: ModelSpec, layout: Layout) -> str | None:
    """The ``-ot`` value that keeps on the CPU the routed experts ``--n-cpu-moe`` would
    (the expert tensors of the GPU layers whose experts are all on the CPU), or None."""
    layers = [spec.moe_layers[m] for m in range(spec.n_moe_layers)
              if layout.layer_device[spec.moe_layers[m]] != CPU and (layout.expert_device[m] == CPU).all()]
    return f"blk\\.({_ranges(layers)})\\.ffn_.*_exps\\.=CPU" if layers else None


def llama_bench_args(args: list[str], n_layers: int) -> tuple[list[str], list[str]]:
    """``llama-server`` / ``llama-cli`` arguments as ``llama-bench`` spells them, and what
    had to be left out. llama-bench (tools/llama-bench/llama-bench.cpp) reads a comma as a
    list of *test values*, so: ``--tensor-split 3,1`` becomes ``-ts 3/1`` (its device
    separator), several ``-ot`` overrides joined by ``,`` are joined by ``;``; it has no
    ``--cpu-moe``, which becomes ``--n-cpu-moe <every layer>``; ``--split-mode`` is ``-sm``;
    it has no ``-c`` (each test's context is its ``-p``, ``-n`` and ``-d``), which is left
    out. ``-m``, ``-ngl``, ``--n-cpu-moe``, ``-t`` and ``-fa`` are spelled alike."""
    if not args:
        return [], []
    out = ["llama-bench" if args[0].startswith("llama-") else args[0]]
    dropped: list[str] = []
    i = 1
    while i < len(args):
        a = args[i]
        if a in ("--cpu-moe", "-cmoe"):  # the one switch llama_cpp() prints; every other flag has a value
            out += ["--n-cpu-moe", str(n_layers)]
            i += 1
            continue
        if i + 1 >= len(args):
            raise MoesimError(f"llama.cpp argument {a} has no value")
        val = args[i + 1]
        if a in ("-c", "--ctx-size"):
            dropped.append(f"{a} {val} left out: llama-bench has no context flag (a test's context is -p + -n + -d)")
        elif a in ("--tensor-split", "-ts"):
            out += ["-ts", val.replace(",", "/")]
        elif a in ("--split-mode", "-sm"):
            out += ["-sm", val]
        elif a in ("-ot", "--override-tensor"):
            out += ["-ot", val.replace(",", ";")]
        else:
            out += [a, val]
        i += 2
    return out, dropped


def _whole_layers(layout: Layout) -> bool:
    """Every MoE layer's experts are all on one processor (what llama.cpp can express)."""
    return all(len(set(row.tolist())) == 1 for row in layout.expert_device)


def ktransformers(spec: ModelSpec, layout: Layout, *, threads: int | None = None, tokens: int | None = None,
                  model_path: str = "MODEL_DIR", gpu_experts_per_layer: int | None = None, **_: object) -> Invocation:
    """KTransformers' command for ``layout``: GPU experts per layer (hot experts) are a flag of
    its SGLang integration (kt-kernel: ``sglang.launch_server`` with ``--kt-*`` options, as its
    tutorials launch it), whole layers of CPU experts an optimize rule of its own launcher
    (``ktransformers.local_chat``; ``tokens``: its ``--max_new_tokens``); one program a line."""
    if layout.n_gpus != 1:
        raise MoesimError("the KTransformers arguments here cover one GPU")
    if gpu_experts_per_layer is not None:
        args = ["python", "-m", "sglang.launch_server", "--model", model_path, "--kt-weight-path", "WEIGHTS_DIR"]
        if threads:
            args += ["--kt-cpuinfer", str(threads)]
        args += ["--kt-num-gpu-experts", str(gpu_experts_per_layer)]
        if spec.expert_dtype.startswith("fp8"):
            args += ["--kt-method", "FP8"]
        return Invocation("ktransformers", args, {}, "KTransformers' SGLang integration (kt-kernel); WEIGHTS_DIR holds "
                          "the experts in the format its --kt-method reads")
    cpu_layers = [spec.moe_layers[m] for m in range(spec.n_moe_layers) if (layout.expert_device[m] == CPU).any()]
    args = ["python", "-m", "ktransformers.local_chat", "--model_path", model_path, "--gguf_path", "GGUF_DIR"]
    if cpu_layers:  # a rule that names no layer would match nothing: none then, every expert on the GPU
        args += ["--optimize_config_path", "moesim-rule.yaml"]
    if threads and cpu_layers:
        args += ["--cpu_infer", str(threads + 1)]  # its convention: the cores used plus the main thread
    if tokens:
        args += ["--max_new_tokens", str(tokens)]
    note = ""
    if not cpu_layers:
        return Invocation("ktransformers", args, {}, note)
    rule = ("- match:\n"
            f"    name: \"^model\\\\.layers\\\\.({_ranges(cpu_layers)})\\\\.mlp\\\\.experts$\"\n"
            "  replace:\n"
            "    class: ktransformers.operators.experts.KTransformersExperts\n"
            "    kwargs:\n"
            "      prefill_device: \"cuda\"\n"
            "      prefill_op: \"KExpertsTorch\"\n"
            "      generate_device: \"cpu\"\n"
            "      generate_op: \"KExpertsCPU\"\n"
            "      out_device: \"cuda\"\n"
            "  recursive: False\n")
    return Invocation("ktransformers", args, {"moesim-rule.yaml": rule}, note)


def vllm(spec: ModelSpec, layout: Layout, *, context: int | None = None, model_path: str = "MODEL",
         **_: object) -> Invocation:
    """vLLM's arguments for ``layout``: every layer on the GPUs; several GPUs sharing each layer
    (a tensor split) as ``--tensor-parallel-size``, which must divide the attention heads and
    the KV heads (or be a multiple of them: vLLM then copies the KV heads), or holding whole
    layers (a layer split) as ``--pipeline-parallel-size`` with the plan's layers per GPU in
    ``VLLM_PP_LAYER_PARTITION`` (vLLM splits evenly without it); the streamed layers' weights
    (:func:`moesim.layout.stream_layers`) as ``--cpu-offload-gb``, GiB per GPU (rounded up to a
    tenth, so every streamed layer is covered), on one GPU or a tensor split only: vLLM offloads
    that much on every GPU, where a layer split streams the first layers, all on one GPU."""
    if (layout.layer_device == CPU).any() or (layout.expert_device == CPU).any():
        raise MoesimError("vLLM computes every layer on the GPUs; it cannot run experts on the CPU")
    n, env = max(layout.n_gpus, 1), []
    if n > 1 and layout.split == "tensor":
        heads, kv = spec.attention.n_heads, spec.attention.n_kv_heads or spec.attention.n_heads
        if heads % n or (kv % n if kv >= n else n % kv):
            raise MoesimError(f"vLLM's --tensor-parallel-size {n} must divide {spec.name}'s {heads} attention heads "
                              f"and its {kv} KV heads (or be a multiple of them)")
        parallel = ["--tensor-parallel-size", str(n)]
    elif n > 1:
        if layout.streamed is not None and layout.streamed.any():
            raise MoesimError("vLLM's --cpu-offload-gb offloads as much on every GPU; this plan streams the first "
                              "layers, all on the first GPU of a layer split")
        env = ["env", f"VLLM_PP_LAYER_PARTITION={','.join(str(x) for x in layout.layers_per_gpu)}"]
        parallel = ["--pipeline-parallel-size", str(n)]
    else:
        parallel = ["--tensor-parallel-size", "1"]
    args = [*env, "vllm", "serve", model_path, *parallel]
    gib = layout.streamed_gib(spec) / n
    if gib > 0:
        args += ["--cpu-offload-gb", f"{math.ceil(gib * 10) / 10:g}"]
    if context:
        args += ["--max-model-len", str(context)]
    return Invocation("vllm", args, {})


#: engine name -> the function that spells a deployment for it
FORMATTERS: dict[str, Callable[..., Invocation]] = {
    "llama.cpp": llama_cpp, "ik_llama.cpp": llama_cpp, "ktransformers": ktransformers, "vllm": vllm,
}


def invocation(engine: str, spec: ModelSpec, layout: Layout, **kw: object) -> Invocation | None:
    """The engine's arguments for ``layout``, or None for an engine moesim cannot spell."""
    f = FORMATTERS.get(engine)
    if f is None:
        return None
    inv = f(spec, layout, **kw)
    if engine == "ik_llama.cpp":
        inv = Invocation("ik_llama.cpp", inv.args, inv.files, inv.note)
    return inv
