"""The `strata` command: `generate` (offline) and `engine` (one worker process)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    GemvKernel,
    KernelBackend,
    KVCacheDtype,
    LoRAConfig,
    ModelLoadError,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
)
from gateway import settings
from gateway.admin_cli import add_admin_commands, run_admin, run_usage
from gateway.logs import configure_logging

_GIB = 1 << 30


def _engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default="default",
        help="'default' (SmolLM2-135M-Instruct), a .gguf file, an HF directory, "
        "or synthetic:<preset>",
    )
    g.add_argument("--dtype", default="auto", help="auto (bf16), bfloat16, float16 or float32")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument(
        "--kv-cache-gb", type=float, default=1.0, help="memory for the paged KV pool, in GiB"
    )
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="exact KV pool size in blocks (overrides --kv-cache-gb)",
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=[d.value for d in KVCacheDtype],
        help="KV page storage: auto (the compute dtype) or fp8_e4m3 (FP8 values with a scale "
        "per token and KV head); default fp8_e4m3 on CUDA, auto elsewhere",
    )
    g.add_argument(
        "--kv-host-gb",
        type=float,
        default=0.0,
        help="host RAM (pinned on CUDA) for prefix-cache pages evicted from the device, in GiB",
    )
    g.add_argument(
        "--kv-disk-gb",
        type=float,
        default=0.0,
        help="disk space for prefix-cache pages evicted from host RAM, in GiB",
    )
    g.add_argument(
        "--kv-disk-path",
        default=None,
        help="directory for the disk tier's page file (default: the system temp directory)",
    )
    g.add_argument(
        "--kv-load",
        default="auto",
        choices=["auto", "sync", "thread", "stream"],
        help="how pages come back from host RAM and disk: layer by layer on a CUDA stream "
        "(stream, CuPy where installed), on a worker thread (thread) or before the step "
        "(sync); auto: stream on CUDA, sync elsewhere",
    )
    g.add_argument(
        "--kv-host-reads",
        default="auto",
        choices=["auto", "kernel", "copy"],
        help="on a CUDA stream, how pages in host RAM are read: by a Triton kernel over PCIe "
        "(kernel) or by CuPy copies on the copy engines, a few per layer for runs of "
        "neighbouring pages (copy); auto: kernel",
    )
    g.add_argument(
        "--kv-spill-ahead",
        action="store_true",
        help="save cooling prefix-cache pages to the host tier between steps, before their "
        "blocks are reused",
    )
    g.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="do not reuse the KV of full blocks shared by earlier prompts",
    )
    g.add_argument(
        "--max-loras",
        type=int,
        default=0,
        help="LoRA adapter slots served at once, from one batch (0: no adapters)",
    )
    g.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank (1-64)")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget of one step (prefill chunk size)",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument(
        "--max-loaded-blocks-per-step",
        type=int,
        default=512,
        help="while requests run, KV pages from host RAM or disk one step may admit",
    )
    g.add_argument(
        "--scheduling-policy",
        default="fair",
        choices=[p.value for p in SchedulingPolicy],
        help="fair: priority, then weighted fair share between tenants (default)",
    )
    g.add_argument(
        "--backend",
        default="auto",
        choices=[k.value for k in KernelBackend],
        help="auto: native kernels on CPU, Triton on CUDA; torch: torch ops only; "
        "triton: force the Triton kernels (interpreted on CPU, slow)",
    )
    g.add_argument(
        "--gemv",
        default="auto",
        choices=[k.value for k in GemvKernel],
        help="one-token steps' products on CUDA: auto (per weight shape, whichever of cuBLAS "
        "and Triton's GEMV timed faster at start), cublas, or triton",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run decode steps eagerly instead of replaying captured CUDA graphs",
    )
    g.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        help="draft tokens per step for greedy requests, looked up in their own context "
        "(prompt-lookup speculative decoding; 0, the default, turns it off)",
    )
    g.add_argument(
        "--prompt-lookup-max",
        type=int,
        default=4,
        help="longest suffix looked up for drafts, in tokens",
    )
    g.add_argument(
        "--prompt-lookup-min",
        type=int,
        default=2,
        help="shortest suffix looked up for drafts, in tokens",
    )
    g.add_argument(
        "--speculative-max-step-drafts",
        type=int,
        default=8,
        help="draft tokens per step, shared by the running requests (none once more run)",
    )
    g.add_argument(
        "--speculative-always",
        action="store_true",
        help="draft whenever a request can be drafted for, instead of only while drafted "
        "steps are measured to produce more tokens per second than plain ones",
    )
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    g.add_argument(
        "--cache-dir",
        default=None,
        help="where dequantized weights are cached (default: $STRATA_CACHE_DIR or ~/.cache/strata)",
    )


def _engine_config(args: argparse.Namespace, seed: int = 0) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        seed=seed,
        num_threads=args.threads,
        cache_dir=args.cache_dir or settings.cache_dir(),
        backend=KernelBackend(args.backend),
        enforce_eager=args.enforce_eager,
        gemv=GemvKernel(args.gemv),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_bytes=max(1, int(args.kv_cache_gb * _GIB)),
            num_blocks=args.num_kv_blocks,
            enable_prefix_caching=args.prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype and KVCacheDtype(args.kv_cache_dtype),
            host_memory_bytes=int(args.kv_host_gb * _GIB),
            disk_bytes=int(args.kv_disk_gb * _GIB),
            disk_path=args.kv_disk_path,
            spill_ahead=args.kv_spill_ahead,
            kv_load=args.kv_load,
            kv_host_reads=args.kv_host_reads,
        ),
        lora=LoRAConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            policy=SchedulingPolicy(args.scheduling_policy),
            max_loaded_blocks_per_step=args.max_loaded_blocks_per_step,
        ),
        speculative=SpeculativeConfig(
            num_speculative_tokens=args.speculative_tokens,
            prompt_lookup_max=args.prompt_lookup_max,
            prompt_lookup_min=args.prompt_lookup_min,
            max_step_drafts=args.speculative_max_step_drafts,
            adaptive=not args.speculative_always,
        ),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline and print it")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument(
        "--json-schema",
        default=None,
        help="constrain the output to JSON of this schema (JSON text, or @file)",
    )
    _engine_options(gen)

    srv = sub.add_parser("serve", help="store + engine worker + gateway on one machine")
    srv.add_argument("--host", default=None, help="default: $STRATA_HOST or 127.0.0.1")
    srv.add_argument("--port", type=int, default=None, help="default: $STRATA_PORT or 8000")
    srv.add_argument("--data-dir", default=None, help="default: $STRATA_DATA_DIR or .strata")
    srv.add_argument(
        "--demo", action="store_true", help="create a demo tenant and print its API key once"
    )
    _engine_options(srv)

    gw = sub.add_parser("gateway", help="one gateway replica (store and workers run elsewhere)")
    gw.add_argument(
        "--engine",
        action="append",
        default=[],
        help="engine worker address (repeatable; default: $STRATA_ENGINE_URLS)",
    )
    gw.add_argument("--redis-url", default=None, help="default: $STRATA_REDIS_URL")
    gw.add_argument("--model", default=None, help="the workers' model spec (for the tokenizer)")
    gw.add_argument("--host", default=None)
    gw.add_argument("--port", type=int, default=None)
    gw.add_argument("--cache-dir", default=None)

    add_admin_commands(sub)

    eng = sub.add_parser("engine", help="run one engine worker")
    eng.add_argument(
        "--listen",
        default="unix://.strata/engine.sock",
        help="unix:///path/to.sock or tcp://host:port",
    )
    eng.add_argument("--seed", type=int, default=0, help="engine random seed")
    _engine_options(eng)
    return parser


def _generate(args: argparse.Namespace) -> int:
    from engine.protocol import SamplingParams  # noqa: PLC0415

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        json_schema=_read_schema(args.json_schema),
    )
    params.validate()  # before spending seconds on importing torch and loading the model
    if params.json_schema is not None:
        from engine.structured import check  # noqa: PLC0415

        check(params.json_schema, None)
    from engine.llm import LLM  # noqa: PLC0415

    llm = LLM(_engine_config(args), progress=True)
    (result,) = llm.generate([args.prompt], params, chat=args.chat)
    print(result.text)
    return 0


def _read_schema(value: str | None) -> str | None:
    """--json-schema's text: as given, or read from the file after an @."""
    if value is None or not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as exc:
        raise ValueError(f"--json-schema: cannot read {value[1:]}: {exc.strerror}") from None


def _engine(args: argparse.Namespace) -> int:
    from engine.factory import create_engine  # noqa: PLC0415
    from engine.worker import run_worker  # noqa: PLC0415

    core, _ = create_engine(_engine_config(args, seed=args.seed), progress=True)
    run_worker(core, args.listen)
    return 0


_ENGINE_FLAGS = (
    "dtype",
    "device",
    "kv_cache_gb",
    "num_kv_blocks",
    "block_size",
    "kv_cache_dtype",
    "kv_host_gb",
    "kv_disk_gb",
    "kv_disk_path",
    "kv_load",
    "kv_host_reads",
    "max_loras",
    "max_lora_rank",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "max_loaded_blocks_per_step",
    "scheduling_policy",
    "speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "speculative_max_step_drafts",
    "backend",
    "gemv",
    "threads",
)
_ENGINE_SWITCHES = ("enforce_eager", "kv_spill_ahead", "speculative_always")  # store_true


def _engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine options given to `serve`, passed on to its worker."""
    defaults = build_parser().parse_args(["engine"])
    argv: list[str] = [] if args.prefix_caching else ["--no-prefix-caching"]
    for name in _ENGINE_FLAGS:
        value = getattr(args, name)
        if value != getattr(defaults, name):
            argv += [f"--{name.replace('_', '-')}", str(value)]
    argv += [f"--{name.replace('_', '-')}" for name in _ENGINE_SWITCHES if getattr(args, name)]
    return argv


def _serve(args: argparse.Namespace) -> int:
    import asyncio  # noqa: PLC0415

    import uvloop  # noqa: PLC0415

    from gateway.serve import serve  # noqa: PLC0415

    gateway_settings = settings.GatewaySettings.from_env(
        model=args.model if args.model != "default" else None,
        host=args.host, port=args.port, data_dir=args.data_dir, cache_dir=args.cache_dir,
    )  # fmt: skip
    configure_logging(settings.log_level(), json=gateway_settings.json_logs)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(gateway_settings, _engine_argv(args), demo=args.demo))
    return 0


def _gateway(args: argparse.Namespace) -> int:
    import uvicorn  # noqa: PLC0415

    from gateway.app import create_app  # noqa: PLC0415

    gateway_settings = settings.GatewaySettings.from_env(
        model=args.model, host=args.host, port=args.port, cache_dir=args.cache_dir,
        redis_url=args.redis_url, engine_addresses=tuple(args.engine) or None,
    )  # fmt: skip
    if gateway_settings.redis_url is None or not gateway_settings.engine_addresses:
        raise ValueError("a gateway replica needs --redis-url and at least one --engine")
    configure_logging(settings.log_level(), json=gateway_settings.json_logs)
    uvicorn.run(
        create_app(gateway_settings),
        host=gateway_settings.host,
        port=gateway_settings.port,
        loop="uvloop",
        http="httptools",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=30,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=settings.log_level(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    from engine.protocol import InvalidRequestError  # noqa: PLC0415
    from engine.tokenizer import ChatTemplateError, TokenizerError  # noqa: PLC0415

    handlers = {
        "gateway": _gateway,
        "generate": _generate,
        "engine": _engine,
        "serve": _serve,
        "admin": run_admin,
        "usage": run_usage,
    }
    try:
        return handlers[args.command](args)
    except (
        ModelLoadError,
        ConfigError,
        InvalidRequestError,
        TokenizerError,
        ChatTemplateError,
        ValueError,
    ) as exc:  # input errors: one line, no traceback
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
