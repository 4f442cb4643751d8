"""Plots of the current benchmark figures, drawn from bench/results/*.json into docs/img/.

For each plot the newest full (not `--quick`) result of the benchmark on each machine kind
is drawn, and the file it came from is named under the plot. Nothing is random and no date
goes into the files, so the same results give the same images.

    python bench/plot.py                      # every plot, into docs/img/
    python bench/plot.py --out /tmp/img       # elsewhere
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parent.parent
AVX512 = "AVX512-BF16 CPU, 2 cores"
AVX2 = "AVX2-only CPU, 2 cores"
H100 = "NVIDIA H100 80GB HBM3"
H100_HOST = "H100 machine's host CPU, 16 cores"
# Runs on the AVX2-only machine from before result files recorded the CPU's instruction level
# (bench/common.py, `instruction_level`); the other 2-core EPYC runs of that time had
# AVX512-BF16.
_AVX2_RUNS = frozenset(
    {
        "cpu_attention-cpu-20261126T182529Z",
        "cpu_attention-cpu-20261126T182544Z",
        "decode_metadata-cpu-20261126T151439Z",
        "decode_metadata-cpu-20261126T154841Z",
    }
)
_ISA_KINDS = {"avx512_bf16": AVX512, "avx2": AVX2}
STRATA, PEER, THIRD = "#2b6cb0", "#a0aec0", "#dd6b20"


@dataclass(frozen=True)
class Result:
    name: str  # the file's stem
    kind: str  # the machine kind it ran on
    data: dict[str, Any]


def machine_kind(stem: str, data: dict[str, Any]) -> str:
    device = str(data.get("device", "cpu"))
    if not device.startswith("cpu"):
        return device
    machine = data.get("machine", {})
    isa = data.get("instruction_level")
    if isa is not None:
        cores = machine.get("cores")
        return _ISA_KINDS.get(isa, f"{isa} CPU") + ("" if cores == 2 else f" ({cores} cores)")
    if "Xeon" in str(machine.get("cpu", "")):
        return H100_HOST
    return AVX2 if stem in _AVX2_RUNS else AVX512


def load_results(directory: Path) -> list[Result]:
    results = []
    for path in sorted(directory.glob("*.json")):  # names end in a UTC stamp: oldest first
        data = json.loads(path.read_text())
        results.append(Result(path.stem, machine_kind(path.stem, data), data))
    return results


def latest(
    results: list[Result],
    benchmark: str,
    kind: str,
    where: Callable[[dict[str, Any]], bool] = lambda _: True,
) -> Result | None:
    """The newest full run of `benchmark` on `kind` for which `where` holds."""
    found = [
        r
        for r in results
        if r.data.get("benchmark") == benchmark
        and r.kind == kind
        and not r.data.get("quick")
        and where(r.data)
    ]
    return found[-1] if found else None


# -- drawing helpers -----------------------------------------------------------------------


def _figure(panels: int, title: str) -> tuple[Figure, list[Axes]]:
    fig, axes = plt.subplots(1, panels, figsize=(max(4.6 * panels, 7.0), 3.4), squeeze=False)
    fig.suptitle(title, fontsize=11)
    return fig, list(axes[0])


def _bars(
    ax: Axes,
    labels: list[str],
    series: list[tuple[str, list[float], str]],
    fmt: str = "{:,.0f}",
    log: bool = False,
) -> None:
    """Grouped bars, each labelled with its value, and headroom above them for the legend."""
    width = 0.8 / len(series)
    for i, (name, values, color) in enumerate(series):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name, color=color)
        ax.bar_label(bars, [fmt.format(v) for v in values], fontsize=7, padding=1)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    ax.spines[["top", "right"]].set_visible(False)
    top = max(v for _, values, _ in series for v in values)
    if log:
        ax.set_yscale("log")
        ax.set_ylim(top=top * 40)
    else:
        ax.set_ylim(0, top * 1.3)
    ax.legend(fontsize=7, frameon=False, loc="upper left", ncol=len(series))


def _source(fig: Figure, results: list[Result | None]) -> None:
    names = ", ".join(f"{r.name}.json" for r in results if r is not None)
    fig.text(0.01, 0.01, f"bench/results/: {names}", fontsize=6, color="#4a5568")
    fig.tight_layout(rect=(0, 0.04, 1, 1))


def _missing(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no result for\n{what}", ha="center", va="center", fontsize=9)
    ax.set_axis_off()


# -- plots ---------------------------------------------------------------------------------


def _greedy_default(d: dict[str, Any]) -> bool:
    return d.get("temperature", 0.0) == 0.0 and d.get("dtype") == "bfloat16"


def _native_16bit(d: dict[str, Any]) -> bool:
    """A run of the CPU's own build on 16-bit weights (as were the runs from before records
    named their `isa` and `weights`)."""
    return d.get("isa", "avx512") == "avx512" and d.get("weights", "16bit") == "16bit"


def _native_peer_run(d: dict[str, Any]) -> bool:
    """A run of the CPU's own build on 16-bit weights, with transformers beside it."""
    return _native_16bit(d) and bool(d.get("hf_tok_s"))


def plot_engine_throughput(results: list[Result]) -> Figure:
    with_ceiling = lambda d: (  # noqa: E731
        _greedy_default(d) and _native_peer_run(d) and bool(d.get("roofline"))
    )
    cpu = latest(results, "engine_throughput", AVX512, with_ceiling)
    gpu = latest(results, "engine_throughput", H100, _greedy_default)
    fig, (left, right) = _figure(2, "Engine throughput against transformers (tokens/s)")
    for ax, run, title in ((left, cpu, AVX512), (right, gpu, H100)):
        if run is None:
            _missing(ax, title)
            continue
        d = run.data
        levels = list(d["strata_tok_s"])
        series = [
            ("Strata", [d["strata_tok_s"][c] for c in levels], STRATA),
            ("transformers", [d["hf_tok_s"][c] for c in levels], PEER),
        ]
        if d.get("roofline"):
            ceiling = d["roofline"]["ceiling_tok_s"]
            series.append(("ceiling", [ceiling[c] for c in levels], THIRD))
        _bars(ax, levels, series)
        ax.set_xlabel("concurrent requests", fontsize=8)
        ax.set_title(f"{title}\n{d['model']}, {d['dtype']}", fontsize=9)
    _source(fig, [cpu, gpu])
    return fig


def plot_gpu_decode(results: list[Result]) -> Figure:
    run = latest(results, "gpu_decode", H100, lambda d: bool(d.get("hf_tok_s")))
    fig, (left, right) = _figure(2, "Decode step on an H100, Llama-3-8B shapes (random weights)")
    if run is None:
        _missing(left, H100)
        _missing(right, H100)
        return fig
    d = run.data
    points = list(d["hf_tok_s"])
    labels = [p.replace("b", "").replace("/c", " × ") for p in points]
    _bars(
        left,
        labels,
        [
            ("Strata, FP8 pages", [d["tok_s"]["fp8"][p] for p in points], STRATA),
            ("Strata, bf16 pages", [d["tok_s"]["bf16"][p] for p in points], THIRD),
            ("transformers", [d["hf_tok_s"][p] for p in points], PEER),
        ],
        log=True,
    )
    left.set_title("tokens/s (log scale)", fontsize=9)
    left.set_xlabel("batch × context", fontsize=8)
    _bars(
        right,
        labels,
        [
            ("FP8 pages", [100 * d["hbm_fraction"]["fp8"][p] for p in points], STRATA),
            ("bf16 pages", [100 * d["hbm_fraction"]["bf16"][p] for p in points], THIRD),
        ],
        fmt="{:.0f}%",
    )
    right.set_title("bytes read per step over copy bandwidth (%)", fontsize=9)
    right.set_xlabel("batch × context", fontsize=8)
    _source(fig, [run])
    return fig


def plot_gateway_overhead(results: list[Result]) -> Figure:
    run = latest(results, "gateway_overhead", AVX512, lambda d: "cpu_ms_per_request" in d)
    fig, (left, right) = _figure(2, f"Gateway overhead, {AVX512}")
    if run is None:
        _missing(left, AVX512)
        _missing(right, AVX512)
        return fig
    d = run.data
    levels = list(d["overhead_ms"])
    _bars(
        left,
        levels,
        [
            ("p50", [d["overhead_ms"][c]["p50"] for c in levels], STRATA),
            ("p99", [d["overhead_ms"][c]["p99"] for c in levels], PEER),
        ],
        fmt="{:.1f}",
    )
    left.set_title("added latency per request (ms)", fontsize=9)
    left.set_xlabel("concurrent clients", fontsize=8)
    _bars(
        right,
        levels,
        [
            ("through the gateway", [d["rps"][c]["gateway"] for c in levels], STRATA),
            ("straight to the worker", [d["rps"][c]["direct"] for c in levels], PEER),
        ],
    )
    right.set_title("requests/s (max_tokens=1)", fontsize=9)
    right.set_xlabel("concurrent clients", fontsize=8)
    _source(fig, [run])
    return fig


def plot_rag_longdoc(results: list[Result]) -> Figure:
    run = latest(results, "rag_longdoc", AVX512)
    fig, (left, right) = _figure(2, f"Long-document QA, {AVX512}")
    if run is None:
        _missing(left, AVX512)
        _missing(right, AVX512)
        return fig
    d = run.data
    _bars(
        left,
        ["TTFT p50", "TTFT p99"],
        [
            ("KV tiers", [d["ttft_p50_ms"]["tiers"], d["ttft_p99_ms"]["tiers"]], STRATA),
            ("recompute", [d["ttft_p50_ms"]["recompute"], d["ttft_p99_ms"]["recompute"]], PEER),
        ],
    )
    left.set_title("time to first token (ms)", fontsize=9)
    gaps = d["with_stream"]
    _bars(
        right,
        ["gap p50", "gap max"],
        [
            (
                "KV tiers",
                [gaps["tiers"]["stream_gap_ms"]["p50"], gaps["tiers"]["stream_gap_ms"]["max"]],
                STRATA,
            ),
            (
                "recompute",
                [
                    gaps["recompute"]["stream_gap_ms"]["p50"],
                    gaps["recompute"]["stream_gap_ms"]["max"],
                ],
                PEER,
            ),
        ],
        log=True,
    )
    right.set_title("a running stream's token gaps (ms, log)", fontsize=9)
    _source(fig, [run])
    return fig


def plot_lora(results: list[Result]) -> Figure:
    cpu = latest(results, "lora", AVX512, lambda d: "ratio_vs_base" in d and _native_16bit(d))
    gpu = latest(results, "lora", H100, lambda d: "ratio_vs_base" in d)
    fig, (ax,) = _figure(1, "Multi-LoRA decode, 32 requests (throughput / base model)")
    configs = ["base_lora_engine", "1", "8", "32"]
    labels = ["slots, no adapter", "1 adapter", "8 adapters", "32 adapters"]
    series = [
        (f"{title}, {run.data['model']}", [run.data["ratio_vs_base"][c] for c in configs], color)
        for run, title, color in ((cpu, AVX512, STRATA), (gpu, "H100", THIRD))
        if run is not None
    ]
    _bars(ax, labels, series, "{:.2f}")
    ax.axhline(1.0, color="#4a5568", linewidth=0.6)
    _source(fig, [cpu, gpu])
    return fig


def plot_speculative(results: list[Result]) -> Figure:
    run = latest(results, "speculative", AVX512, lambda d: d.get("temperature", 0.0) == 0.0)
    fig, (ax,) = _figure(1, f"Prompt-lookup speculative decoding, {AVX512}")
    if run is None:
        _missing(ax, AVX512)
        return fig
    speedup = run.data["speedup"]
    levels = sorted({k.split("/")[1] for k in speedup}, key=int)
    _bars(
        ax,
        levels,
        [
            ("rag (quotes a document)", [speedup[f"rag/{c}"] for c in levels], STRATA),
            ("chat (no document)", [speedup[f"chat/{c}"] for c in levels], PEER),
        ],
        "{:.2f}",
    )
    ax.axhline(1.0, color="#4a5568", linewidth=0.6)
    ax.set_xlabel("concurrent requests", fontsize=8)
    ax.set_ylabel("speedup over plain decoding", fontsize=8)
    _source(fig, [run])
    return fig


def plot_kv_tiers(results: list[Result]) -> Figure:
    cpu = latest(results, "kv_tiers", AVX512)
    gpu = latest(results, "kv_tiers", H100)
    fig, axes = _figure(2, "KV page copies between tiers (GB/s, 256 pages)")
    paths = ["device_to_host", "host_to_device", "host_to_disk", "disk_to_host"]
    labels = ["dev → host", "host → dev", "host → disk", "disk → host"]
    for ax, run, title in zip(axes, (cpu, gpu), (AVX512, H100), strict=True):
        if run is None:
            _missing(ax, title)
            continue
        d = run.data
        _bars(
            ax,
            labels,
            [
                ("tier path", [d["gb_per_s"][p] for p in paths], STRATA),
                ("raw copy", [d["raw_gb_per_s"][p] for p in paths], PEER),
            ],
            "{:.1f}",
        )
        ax.set_title(title, fontsize=9)
    _source(fig, [cpu, gpu])
    return fig


def plot_structured_output(results: list[Result]) -> Figure:
    run = latest(results, "structured_output", AVX512, lambda d: d.get("comparable", True))
    fig, (ax,) = _figure(1, f"JSON Schema output against free text, {AVX512}")
    if run is None:
        _missing(ax, AVX512)
        return fig
    d = run.data
    # runs since the grammar engine compared two backends: the default one (llguidance)
    by_level = d["throughput"]["llguidance"] if "throughput" in d else None
    if by_level is not None:
        levels = list(by_level)
        with_schema = [by_level[c]["with_schema_tok_s"] for c in levels]
        without = [by_level[c]["without_tok_s"] for c in levels]
    else:
        levels = list(d["with_schema_tok_s"])
        with_schema = [d["with_schema_tok_s"][c] for c in levels]
        without = [d["without_tok_s"][c] for c in levels]
    _bars(ax, levels, [("with the schema", with_schema, STRATA), ("without", without, PEER)])
    ax.set_xlabel("concurrent requests", fontsize=8)
    ax.set_ylabel("tokens/s", fontsize=8)
    _source(fig, [run])
    return fig


def plot_cpu_attention(results: list[Result]) -> Figure:
    run = latest(results, "cpu_attention", AVX2)
    fig, axes = _figure(2, f"Native CPU attention by page format, {AVX2} (ms)")
    if run is None:
        for ax in axes:
            _missing(ax, AVX2)
        return fig
    ms = run.data["ms"]
    formats = ["f32", "bf16", "fp8"]
    for ax, shape in zip(axes, ("prefill", "decode"), strict=True):
        spec = run.data["shapes"][shape]
        _bars(
            ax,
            ["32-bit", "bf16", "FP8"],
            [
                ("native build", [ms["native"][f"{shape}/{f}"] for f in formats], STRATA),
                ("portable build", [ms["portable"][f"{shape}/{f}"] for f in formats], PEER),
            ],
        )
        ax.set_title(f"{shape}: {spec['rows']} rows over {spec['cached']:,} tokens", fontsize=9)
    _source(fig, [run])
    return fig


PLOTS: dict[str, Callable[[list[Result]], Figure]] = {
    "engine_throughput": plot_engine_throughput,
    "gpu_decode": plot_gpu_decode,
    "gateway_overhead": plot_gateway_overhead,
    "rag_longdoc": plot_rag_longdoc,
    "lora": plot_lora,
    "speculative": plot_speculative,
    "kv_tiers": plot_kv_tiers,
    "structured_output": plot_structured_output,
    "cpu_attention": plot_cpu_attention,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(ROOT / "bench/results"))
    parser.add_argument("--out", default=str(ROOT / "docs/img"))
    args = parser.parse_args(argv)
    plt.switch_backend("Agg")  # files only, on any machine
    plt.rcParams.update({"font.family": "DejaVu Sans"})
    results = load_results(Path(args.results))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, draw in PLOTS.items():
        fig = draw(results)
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100, metadata={"Software": None})
        plt.close(fig)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
