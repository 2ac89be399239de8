"""PNG plots of a results JSON (matplotlib, headless): speedup, acceptance, serving latency.

matplotlib is imported only here and only when plotting, so a machine without it (the GPU host)
still runs the benchmark; ``mtpserve bench report FILE.json`` makes the plots later elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _temperatures(runs: list[dict[str, Any]]) -> list[float]:
    return sorted({r["temperature"] for r in runs})


def speedup_plot(runs: list[dict[str, Any]], path: Path) -> Path | None:
    done = [r for r in runs if r["speedup_vs_ar"] is not None]
    if not done:
        return None
    plt = _pyplot()
    temps = _temperatures(done)
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps, strict=True):
        for label in sorted({r["label"] for r in done}):
            pts = sorted((r["batch_size"], r["speedup_vs_ar"], r["speedup_vs_ar_min"], r["speedup_vs_ar_max"])
                         for r in done if r["label"] == label and r["temperature"] == t)
            if not pts:
                continue
            xs, ys, lo, hi = zip(*pts, strict=True)
            err = [[y - a for y, a in zip(ys, lo, strict=True)], [b - y for y, b in zip(ys, hi, strict=True)]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("speedup over ar (tokens/s)")
        ax.set_title(f"temperature {t:g}")
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def acceptance_plot(runs: list[dict[str, Any]], path: Path) -> Path | None:
    spec = [r for r in runs if r["acceptance_per_position"] and r["mode"] not in ("ar",)]
    if not spec:
        return None
    bs = min(r["batch_size"] for r in spec)
    temps = _temperatures(spec)
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps, strict=True):
        for r in sorted((r for r in spec if r["batch_size"] == bs and r["temperature"] == t),
                        key=lambda r: r["label"]):
            acc = r["acceptance_per_position"]
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=r["label"])
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("draft depth d")
        ax.set_ylabel("share of steps accepting depth d")
        ax.set_title(f"batch {bs}, temperature {t:g}")
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def latency_plot(serve: dict[str, Any], path: Path) -> Path | None:
    runs = serve.get("runs") or []
    if not runs:
        return None
    plt = _pyplot()
    metrics = [("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(16, 3.8))
    width = 0.8 / len(runs)
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for i, r in enumerate(runs):
            vals = [r[key][q] or 0.0 for q in ("p50", "p90", "p99")]
            ax.bar([x + i * width for x in range(3)], vals, width, label=f"spec {r['spec_method']}")
        ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(3)], ["p50", "p90", "p99"])
        ax.set_title(f"{title} (ms)")
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def write_plots(doc: dict[str, Any], folder: Path, stem: str) -> list[Path]:
    """The PNGs that apply to ``doc`` (none, with a note, when matplotlib is missing)."""
    try:
        _pyplot()
    except ImportError:
        print("matplotlib is not installed: no plots (run `mtpserve bench report` elsewhere)")
        return []
    runs = doc.get("runs", [])
    made = [speedup_plot(runs, folder / f"{stem}-speedup.png"),
            acceptance_plot(runs, folder / f"{stem}-acceptance.png")]
    if doc.get("serve"):
        made.append(latency_plot(doc["serve"], folder / f"{stem}-latency.png"))
    return [p for p in made if p is not None]
