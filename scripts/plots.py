"""The benchmark plots of the docs, drawn from the committed result files in bench/results/ into docs/img/*.svg.

    python scripts/plots.py            # (re)writes docs/img/*.svg
    python scripts/plots.py --out DIR  # writes them into DIR instead (the docs test compares the two)

One function per figure, each reading the result files it names (a file that is missing or lacks a field it needs
fails the run), each figure naming its card, commit and date in its footer. The SVGs are deterministic (a fixed
hash salt, no date or creator in their metadata, text kept as text), so re-running changes nothing unless the data
or this script did.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
OUT = REPO / "docs" / "img"
Q3TTS, PEER, PEER2, GREY = "#1f6feb", "#d1242f", "#9a6700", "#6e7781"
BEHIND = "#cf222e"

plt.rcParams.update({"svg.hashsalt": "q3tts-docs", "svg.fonttype": "none", "font.size": 9,
                     "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
                     "grid.alpha": 0.3, "legend.frameon": False, "figure.dpi": 100})


def load(name: str) -> dict:
    """A result file and its provenance; KeyError/FileNotFoundError name what is missing."""
    path = RESULTS / name
    data = json.loads(path.read_text())
    for key in ("card", "commit", "date", "results"):
        if key not in data:
            raise KeyError(f"{path}: no {key!r}")
    return data


def source(data: dict, name: str) -> str:
    return f"{name}: {data['card']}, commit {data['commit']}, {data['date'][:10]}"


def footer(fig, *lines: str) -> None:
    """The data's provenance under the axes (bbox_inches="tight" grows the figure to hold it)."""
    fig.text(0.01, -0.02, "\n".join(lines), fontsize=7, color=GREY, va="top")


def rate_ticks(ax, rates) -> None:
    """Ticks at the offered rates themselves, as plain numbers (also on a log axis)."""
    rates = sorted(set(rates))
    ax.set_xticks(rates, [f"{r:g}" for r in rates])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())


def plain_log_y(ax, ticks) -> None:
    ax.set_yscale("log")
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())


def save(fig, out: Path, name: str) -> None:
    fig.savefig(out / name, format="svg", metadata={"Date": None, "Creator": None}, bbox_inches="tight")
    plt.close(fig)


def rows(data: dict, **match) -> list[dict]:
    return [r for r in data["results"] if all(r.get(k) == v for k, v in match.items())]


# ---- ms per frame against batch size ---------------------------------------------------------------------------

def decode_batch(out: Path) -> None:
    """q3tts's frame time at each batch size, both sizes, beside faster-qwen3-tts (batch 1 only) in the same run."""
    name = "2026-12-04-decode-peers-h200.json"
    data = load(name)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4), sharey=True)
    for ax, size in zip(axes, ("0.6B-Base", "1.7B-Base")):
        ours = sorted(rows(data, engine="q3tts", model=size), key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in ours], [r["ms_per_frame"] for r in ours], "o-", color=Q3TTS, label="q3tts")
        for r in ours:
            ax.annotate(f"{r['ms_per_frame']:.2f}", (r["batch"], r["ms_per_frame"]), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=7, color=Q3TTS)
        ms = rows(data, engine="faster-qwen3-tts", model=size, benchmark="decode")[0]["ms_per_frame"]
        ax.plot([1], [ms], "s", color=PEER, label="faster-qwen3-tts (batch 1 only)")
        ax.annotate(f"{ms:.1f}", (1, ms), textcoords="offset points", xytext=(8, -3), fontsize=7, color=PEER)
        ax.axhline(80, color=GREY, lw=0.8, ls=":")
        ax.text(1, 80, " real time per stream (80 ms)", fontsize=7, color=GREY, va="bottom")
        ax.set(xscale="log", title=size, xlabel="batch size (streams decoded together)", ylim=(1.5, 120))
        rate_ticks(ax, [1, 64, 128, 256])
        plain_log_y(ax, [2, 3, 5, 10, 20, 50, 80])
    axes[0].set_ylabel("ms per frame (80 ms of audio per stream)")
    axes[1].legend(loc="center right")
    fig.suptitle("Decode: ms per codec frame against batch size", fontsize=10)
    footer(fig, source(data, name), "random weights at the real configs, EOS off, end to end (codec included); "
           "peer measured in the same run")
    save(fig, out, "decode-batch.svg")


def decode_sweep(out: Path) -> None:
    """The batch sweep beside faster-qwen3-tts-batch (its batched CUDA graphs) in one H100 run."""
    name = "2026-11-26-decode-h100.json"
    data = load(name)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4), sharey=True)
    for ax, size in zip(axes, ("0.6B-Base", "1.7B-Base")):
        for engine, color, marker in (("q3tts", Q3TTS, "o-"), ("faster-qwen3-tts-batch", PEER2, "^-")):
            series = sorted(rows(data, engine=engine, model=size), key=lambda r: r["batch"])
            ax.plot([r["batch"] for r in series], [r["ms_per_frame"] for r in series], marker, color=color,
                    label=engine)
        single = rows(data, engine="faster-qwen3-tts", model=size)
        ax.plot([1], [single[0]["ms_per_frame"]], "s", color=PEER, label="faster-qwen3-tts")
        ax.set(xscale="log", title=size, xlabel="batch size")
        rate_ticks(ax, [1, 2, 4, 8, 16, 32, 64, 128, 256])
        plain_log_y(ax, [4, 5, 7, 10, 20, 30, 50])
    axes[0].set_ylabel("ms per frame")
    axes[0].legend(loc="upper left")
    fig.suptitle("Decode: a batch sweep beside faster-qwen3-tts-batch (an earlier q3tts)", fontsize=10)
    footer(fig, source(data, name), "random weights, EOS off; peers measured in the same run")
    save(fig, out, "decode-sweep-h100.svg")


# ---- first audio per voice kind --------------------------------------------------------------------------------

def first_audio(out: Path) -> None:
    """Time to first audio per voice kind, one stream and a burst of 64, the voice's prefix cached or not."""
    name = "2026-11-29-streaming-headphase-h200.json"
    data = load(name)
    kinds = [("x-vector", "x-vector"), ("x-vector, a new voice per stream", "x-vector,\na new one\neach stream"),
             ("in-context 3 s", "in-context,\n3 s ref."), ("in-context 10 s", "in-context,\n10 s ref.")]
    by_voice = rows(data, benchmark="first_audio_by_voice")
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4), sharey=True)
    for ax, batch in zip(axes, (1, 64)):
        for i, (voice, _) in enumerate(kinds):
            for j, cached in enumerate((False, True)):
                hit = [r for r in by_voice if r["voice"] == voice and r["batch"] == batch
                       and r["prefix_cached"] == cached]
                if not hit:
                    continue
                x, ms = i + (j - 0.5) * 0.38, hit[0]["ttfa_ms_p50"]
                ax.bar(x, ms, 0.36, color=Q3TTS, alpha=0.55 if not cached else 1.0,
                       label=("voice seen before (prefix cached)" if cached else "voice not cached")
                       if i == 0 else None)
                ax.text(x, ms, f"{ms:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(kinds)), [label for _, label in kinds], fontsize=7)
        ax.set_title("one stream" if batch == 1 else "a burst of 64 requests at once")
        ax.grid(axis="x", visible=False)
    peer = rows(data, engine="faster-qwen3-tts")[0]["ttfa_ms_p50"]
    axes[0].set_ylabel("first audio, ms (p50)")
    axes[0].legend(loc="upper left", fontsize=7)
    fig.suptitle(f"Time to first audio per voice kind (1.7B-Base); faster-qwen3-tts in the same run: "
                 f"{peer:.0f} ms for one stream", fontsize=10)
    footer(fig, source(data, name), "q3tts bench streaming: random weights at the real config; first 80 ms frame "
           "handed out")
    save(fig, out, "first-audio-voices.svg")


# ---- serving: first audio against offered load -----------------------------------------------------------------

def _serving_series(ax, series: list[dict], color: str, marker: str, label: str) -> None:
    series = sorted(series, key=lambda r: r["rps"])
    rates = [r["rps"] for r in series]
    ax.plot(rates, [r["ttfa_ms_p50"] for r in series], marker + "--", color=color, alpha=0.6, lw=1)
    ax.plot(rates, [r["ttfa_ms_p95"] for r in series], marker + "-", color=color, label=label)
    for r in series:
        if r.get("behind_realtime_share"):
            ax.plot(r["rps"], r["ttfa_ms_p95"], "o", ms=11, mfc="none", mec=BEHIND, mew=1.4)
            ax.annotate(f"{100 * r['behind_realtime_share']:.2f}% behind", (r["rps"], r["ttfa_ms_p95"]),
                        textcoords="offset points", xytext=(6, -10), fontsize=6, color=BEHIND)


def serving(out: Path) -> None:
    """First audio p50 (dashed) / p95 (solid) against offered requests per second, in-process and over HTTP; a red
    ring marks a run in which some stream fell behind real time."""
    inproc_name, http_name = "2026-11-29-serving-h200.json", "2026-11-30-serving-http-h200.json"
    h100_name = "2026-11-27-serving-http-front-h100.json"
    inproc, http, h100 = load(inproc_name), load(http_name), load(h100_name)
    fig, axes = plt.subplots(1, 2, figsize=(8.6, 3.6))
    ax = axes[0]
    _serving_series(ax, inproc["results"], Q3TTS, "o", f"in-process ({inproc['commit']})")
    first_start = [r for r in http["results"] if r.get("server_start") == 1]
    _serving_series(ax, first_start, PEER2, "s", f"over HTTP, front + engine ({http['commit']})")
    again = [r for r in http["results"] if r.get("server_start") == 2]
    ax.plot([r["rps"] for r in again], [r["ttfa_ms_p95"] for r in again], "s", color=PEER2, mfc="none",
            label="over HTTP, a second server start")
    ax.set(title=f"{inproc['card']}: 1.7B, 6-14 s clones", xlabel="offered requests per second (Poisson)",
           ylabel="first audio, ms (p95 solid, p50 dashed)", ylim=(0, 80), xlim=(110, 135))
    rate_ticks(ax, [r["rps"] for r in inproc["results"] + http["results"]])
    ax.legend(loc="lower right", fontsize=7)
    ax = axes[1]  # one H100 host ("machine B"): every row of that host
    host = [r for r in h100["results"] if r.get("machine") == "B"]
    engine_rows = [r for r in host if r["engine"] == "q3tts"]
    front = [r for r in host if "front" in r["engine"] and "second" in r.get("run", "") and r["commit"] == "61de6ab"]
    single = [r for r in host if "one process" in r["engine"]]
    _serving_series(ax, engine_rows, Q3TTS, "o", f"in-process ({engine_rows[0]['commit']})")
    _serving_series(ax, front, PEER2, "s", "HTTP, front + engine (61de6ab)")
    _serving_series(ax, single, GREY, "v", "HTTP, --single-process")
    ax.set(title=f"{h100['card']}, one host", xlabel="offered requests per second (Poisson)")
    rate_ticks(ax, [r["rps"] for r in host])
    plain_log_y(ax, [20, 30, 50, 100, 200, 500, 1000])
    ax.legend(loc="upper left", fontsize=7)
    fig.suptitle("Serving: first audio against offered load (red ring: some stream fell behind real time)",
                 fontsize=10)
    footer(fig, source(inproc, inproc_name), source(http, http_name), source(h100, h100_name) +
           " (rows of host B; each row's own commit)",
           "random weights at the real 1.7B-Base config, EOS off; no peer: faster-qwen3-tts has no batching server")
    save(fig, out, "serving.svg")


# ---- capacity per GPU count ------------------------------------------------------------------------------------

def capacity(out: Path) -> None:
    """p95 first audio against offered load for one engine and two behind the front, and the capacity each holds at
    p95 <= 50 ms."""
    name = "2026-11-26-scale-out-h100x2.json"
    data = load(name)
    limit = data["capacity"]["ttfa_ms_p95_max"]
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.2), gridspec_kw={"width_ratios": [2, 1], "wspace": 0.3})
    ax = axes[0]
    for gpus, color, marker in ((1, Q3TTS, "o"), (2, PEER2, "s")):
        _serving_series(ax, rows(data, gpus=gpus), color, marker, f"{gpus} GPU" + "s" * (gpus > 1))
    ax.axhline(limit, color=GREY, ls=":", lw=0.8)
    ax.text(40, limit, f" p95 {limit:.0f} ms", fontsize=7, color=GREY, va="bottom")
    ax.set(xlabel="offered requests per second", ylabel="first audio, ms (p95 solid, p50 dashed)", ylim=(0, 90))
    rate_ticks(ax, [r["rps"] for r in data["results"]])
    ax.legend(loc="upper left", fontsize=7)
    ax = axes[1]
    capacity_rps = {int(k): v for k, v in data["capacity"]["capacity_rps"].items()}
    bars = ax.bar([str(g) for g in capacity_rps], list(capacity_rps.values()), color=[Q3TTS, PEER2])
    ax.bar_label(bars, [f"{v:.0f}/s" for v in capacity_rps.values()], fontsize=7)
    ax.set(xlabel="GPUs behind one endpoint", title=f"requests/s at p95 <= {limit:.0f} ms")
    ax.grid(axis="x", visible=False)
    fig.suptitle(f"Capacity per GPU count: {data['capacity']['ratio']:.1f}x with two engines behind one front",
                 fontsize=10)
    footer(fig, source(data, name) + " (2 GPUs)", "q3tts serve --devices, 1.7B, 6-14 s clones, HTTP load from 4 "
           "processes, rates in steps of 10 requests/s")
    save(fig, out, "capacity-gpus.svg")


# ---- tts-bench ladder ------------------------------------------------------------------------------------------

def tts_bench(out: Path) -> None:
    """tts-bench's p95 first audio per request rate (median over seeds, the seeds' range as a bar), q3tts and
    nari-qwen3-tts on one card; an underrun (a stream that ran dry) is ringed."""
    name = "2026-12-02-tts-bench-h200.json"
    data = load(name)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for engine, target, color, marker, label in (
            ("q3tts", "nari", Q3TTS, "o", "q3tts (tts-bench --target nari)"),
            ("q3tts", "vllm-omni", Q3TTS, "D", "q3tts (--target vllm-omni)"),
            ("nari-qwen3-tts", "nari", PEER, "s", "nari-qwen3-tts (profile ttfa)")):
        runs = rows(data, engine=engine, target=target)
        rates = sorted({r["rps"] for r in runs})
        p95 = [[r["ttfa_ms_p95"] for r in runs if r["rps"] == rate] for rate in rates]
        mid = [statistics.median(v) for v in p95]
        err = [[m - min(v) for m, v in zip(mid, p95)], [max(v) - m for m, v in zip(mid, p95)]]
        ax.errorbar(rates, mid, yerr=err, fmt=marker + ("-" if target == "nari" else ""), color=color, capsize=3,
                    label=label, mfc="none" if target == "vllm-omni" else color)
        for rate in rates:
            dry = sum(r["underrun_requests"] for r in runs if r["rps"] == rate)
            if dry:
                ax.plot(rate, mid[rates.index(rate)], "o", ms=12, mfc="none", mec=BEHIND, mew=1.4)
                ax.annotate(f"{dry} underrun", (rate, mid[rates.index(rate)]), textcoords="offset points",
                            xytext=(8, 6), fontsize=7, color=BEHIND)
    ax.axhline(50, color=GREY, ls=":", lw=0.8)
    ax.text(2, 50, " 50 ms", fontsize=7, color=GREY, va="bottom")
    ax.set(xscale="log", xlabel="requests per second (Poisson, 4 s utterances)",
           ylabel="first playable audio, ms (p95)", ylim=(0, 80))
    rate_ticks(ax, [r["rps"] for r in data["results"]])
    ax.legend(loc="upper left", fontsize=7)
    fig.suptitle("tts-bench (nari-labs/benchmarks), 1.7B-CustomVoice over HTTP, one card", fontsize=10)
    footer(fig, source(data, name), "median over 3 seeds of each seed's p95 (bars: the seeds' range); both engines "
           "in one lease on one machine, 5 min apart")
    save(fig, out, "tts-bench.svg")


FIGURES = (decode_batch, decode_sweep, first_audio, serving, capacity, tts_bench)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="folder for the SVGs (default: docs/img)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for figure in FIGURES:
        figure(args.out)
    print(f"{len(FIGURES)} figures in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
