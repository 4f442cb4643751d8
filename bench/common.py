"""Shared benchmark plumbing: machine description, scratch directories, result files, the
transformers peer."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """This CPU's flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def instruction_level(flags: set[str] | None = None, arch: str | None = None) -> str:
    """The widest vector instructions of this CPU, as the kernels use them: `avx512_bf16`
    (bf16 dot products), `avx512`, `avx2`, `sse4` or `other` on x86 (from the flags of
    /proc/cpuinfo unless `flags` is given); the architecture's name elsewhere."""
    arch = (arch if arch is not None else platform.machine()).lower()
    if arch not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return arch or "unknown"
    flags = cpu_flags() if flags is None else flags
    if flags & {"avx512_bf16", "avx512bf16"}:
        return "avx512_bf16"
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags:
        return "avx2"
    if flags & {"sse4_1", "sse4_2"}:
        return "sse4"
    return "other"


# What holds the peers to AVX2 on a CPU that has AVX-512, so that `--cpu-isa avx2` measures
# every engine as an AVX2-only CPU would run it: torch's own kernels, oneDNN (its bf16
# matmuls) and MKL by their switches, llama.cpp by a build for AVX2 (`make bench-peers-avx2`)
AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def llamacpp_avx2_lib() -> Path:
    """Where `make bench-peers-avx2` puts llama.cpp's libraries built for AVX2 alone."""
    return Path(sys.prefix) / "llama-cpp-avx2" / "lib"


def peers_held_to_avx2(environ: dict[str, str] | None = None) -> bool:
    """Whether this process runs torch (and so transformers) at AVX2."""
    env = os.environ if environ is None else environ
    return all(env.get(k) == v for k, v in AVX2_ENV.items())


def avx2_peer_env(
    environ: dict[str, str], flags: set[str] | None = None, lib: Path | None = None
) -> dict[str, str] | None:
    """The environment that holds the peers to AVX2 on this CPU, or None where there is
    nothing to hold: they already are, or the CPU has no AVX-512."""
    if peers_held_to_avx2(environ) or "avx512f" not in (cpu_flags() if flags is None else flags):
        return None
    env = {**environ, **AVX2_ENV}
    lib = llamacpp_avx2_lib() if lib is None else lib
    if (lib / "libllama.so").exists():
        env["LLAMA_CPP_LIB_PATH"] = str(lib)
    return env


def peers_isa(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The instruction level each peer ran at: for the result record."""
    env = os.environ if environ is None else environ
    torch_isa = "avx2" if peers_held_to_avx2(env) else instruction_level()
    llama = env.get("LLAMA_CPP_LIB_PATH")
    llama_isa = "avx2" if llama and Path(llama) == llamacpp_avx2_lib() else instruction_level()
    return {"transformers": torch_isa, "llama.cpp": llama_isa}


def _mem_gib() -> float:
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return round(pages / (1 << 30), 1)
    except (ValueError, OSError):
        return 0.0


def machine_info(device: torch.device) -> dict[str, Any]:
    """Who ran this: host, CPU and its instruction level, memory, accelerator, library
    versions, date (UTC)."""
    info: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "hostname": socket.gethostname(),
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "memory_gib": _mem_gib(),
            "torch_threads": torch.get_num_threads(),
        },
        "instruction_level": instruction_level(),
        "device": "cpu",
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
    else:
        info["device"] = f"cpu ({_cpu_model()})"
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def parse_args(
    ap: argparse.ArgumentParser, argv: list[str] | None, **quick: Any
) -> argparse.Namespace:
    """`ap`'s options from `argv`; with `--quick`, `quick`'s values are the defaults
    instead, so options given on the command line still win (a smoke test shrinks a
    quick run further)."""
    args = ap.parse_args(argv)
    if args.quick:
        ap.set_defaults(**quick)
        args = ap.parse_args(argv)
    return args


def add_cache_dir_argument(ap: argparse.ArgumentParser) -> None:
    """`--cache-dir`, where an engine keeps dequantized weights and its built kernels:
    by default the CLI's, so that a run leaves nothing in the temporary directory."""
    from gateway.settings import cache_dir

    ap.add_argument(
        "--cache-dir",
        default=cache_dir(),
        help="dequantized weights and built kernels (default: as the CLI's, "
        "$STRATA_CACHE_DIR, else ~/.cache/strata)",
    )


def add_cpu_engine_arguments(ap: argparse.ArgumentParser) -> None:
    """`--cpu-isa` and `--weights`: the instruction level of the engines' native CPU kernels,
    and how they hold the projections' weights (EngineConfig's options of those names)."""
    from engine.config import CpuIsa, EngineConfig, WeightFormat

    ap.add_argument(
        "--cpu-isa",
        default="auto",
        choices=[i.value for i in CpuIsa],
        help="instruction level of the native CPU kernels (auto: the best this CPU has)",
    )
    ap.add_argument(
        "--weights",
        default=EngineConfig.weights.value,
        choices=[w.value for w in WeightFormat],
        help="the engines' --weights (fastest: per CPU, the default; auto: as the model file "
        "holds them)",
    )


def engine_record(benchmark: str, core: Any, model_spec: str) -> dict[str, Any]:
    """The head of a result record for a run of one engine: the machine, and what it served."""
    return {
        "benchmark": benchmark,
        **machine_info(core.device),
        "model": core.model_id,
        "model_spec": model_spec,
        "synthetic_weights": model_spec.startswith("synthetic:"),
        "dtype": str(core.dtype).removeprefix("torch."),
    }


def write_result(out_dir: str, name: str, record: dict[str, Any]) -> Path:
    device = "cuda" if "cpu" not in str(record.get("device", "cpu")) else "cpu"
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = Path(out_dir) / f"{name}-{device}-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def generate_all(core: Any, prompts: list[list[int]], params: list[Any]) -> tuple[float, list]:
    """Submit every prompt with its SamplingParams to an EngineCore and step it until all
    finish: output tokens/s over the whole batch, and each request's output token ids in
    prompt order."""
    start = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(f"bench-{i}", prompt, p)
    outputs: dict[str, list[int]] = {f"bench-{i}": [] for i in range(len(prompts))}
    while core.has_unfinished():
        for out in core.step():
            outputs[out.request_id].extend(out.new_token_ids)
    elapsed = time.perf_counter() - start
    tokens = [outputs[f"bench-{i}"] for i in range(len(prompts))]
    return sum(map(len, tokens)) / elapsed, tokens


def timed_calls(
    fn: Callable[[], object],
    repeats: int,
    warmup: int = 0,
    between: Callable[[], object] | None = None,
) -> list[float]:
    """Host seconds of each of `repeats` calls of `fn`, after `warmup` untimed ones;
    `between` runs untimed after each timed call (a device sync, a change of inputs)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if between is not None:
            between()
    return times


def publish(out_dir: str, name: str, record: dict[str, Any], summary: dict[str, Any]) -> Path:
    """Write the full record to `out_dir` and print where, then `summary` as the last line
    (one JSON object, what the issues ask a benchmark to print). Every benchmark ends here,
    after its scratch directories are gone, so nothing prints after the summary."""
    path = write_result(out_dir, name, record)
    print(f"wrote {path}")
    sys.stderr.flush()  # whatever went to stderr comes before the summary on a shared terminal
    print(json.dumps(summary), flush=True)
    return path


@contextlib.contextmanager
def scratch_dir(prefix: str, under: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """A fresh directory for one run (in `under`, else the system's temporary directory),
    removed with everything in it on exit, on an error too. Only this directory is removed:
    `under` itself, a user's `--disk-path`, keeps whatever else it holds.

    Engines and tiers given a path inside it may leave entries there (the disk tier's
    `strata-kv/`, a store's files, sockets), so the whole tree goes. A failed removal is
    reported on stderr rather than raised, so it cannot cost a run its figures."""
    if under is not None:
        Path(under).mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=under))
    try:
        yield path
    finally:
        try:
            shutil.rmtree(path)
        except OSError as exc:
            print(f"warning: could not remove {path}: {exc}", file=sys.stderr)


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Strata's fused parameters split back into transformers' Llama names."""
    cfg = model.config  # type: ignore[attr-defined]
    sd = model.state_dict()
    out = {
        "model.embed_tokens.weight": sd["embed_tokens.weight"],
        "model.norm.weight": sd["norm.weight"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    q, kv = cfg.q_size, cfg.kv_size
    for i in range(cfg.num_layers):
        p, hp = f"layers.{i}", f"model.layers.{i}"
        wq, wk, wv = sd[f"{p}.qkv_proj.weight"].split((q, kv, kv))
        out |= {
            f"{hp}.self_attn.q_proj.weight": wq,
            f"{hp}.self_attn.k_proj.weight": wk,
            f"{hp}.self_attn.v_proj.weight": wv,
            f"{hp}.self_attn.o_proj.weight": sd[f"{p}.o_proj.weight"],
            f"{hp}.input_layernorm.weight": sd[f"{p}.input_norm.weight"],
            f"{hp}.post_attention_layernorm.weight": sd[f"{p}.post_attn_norm.weight"],
            f"{hp}.mlp.down_proj.weight": sd[f"{p}.down_proj.weight"],
        }
        gate, up = sd[f"{p}.gate_up_proj.weight"].chunk(2)
        out[f"{hp}.mlp.gate_proj.weight"] = gate
        out[f"{hp}.mlp.up_proj.weight"] = up
        if cfg.attention_bias:
            bq, bk, bv = sd[f"{p}.qkv_proj.bias"].split((q, kv, kv))
            out |= {
                f"{hp}.self_attn.q_proj.bias": bq,
                f"{hp}.self_attn.k_proj.bias": bk,
                f"{hp}.self_attn.v_proj.bias": bv,
            }
    return out


def hf_model_for(config: Any) -> torch.nn.Module:
    """The transformers peer with exactly the weights the engine runs (same dtype, device).

    Built from the same checkpoint as the engine (for synthetic models: the same seed), via
    an untransformed Strata model whose fused weights are split back into HF names.
    """
    import transformers
    from packaging.version import Version
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.loader import build_model, load_checkpoint

    checkpoint = load_checkpoint(config.model, config.cache_dir, progress=False, seed=config.seed)
    device, dtype = config.torch_device(), config.torch_dtype()
    model = build_model(checkpoint, dtype, device)
    raw = model.config.to_hf()
    hf_config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    # `dtype` since transformers 4.56; a GPU image may carry an older one
    key = "torch_dtype" if Version(transformers.__version__) < Version("4.56") else "dtype"
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_config, **{key: dtype})
    assert next(hf.parameters()).dtype == dtype
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    assert not unexpected, unexpected
    assert all("rotary" in k for k in missing), missing
    del model
    return hf.eval()
