"""`python -m adapter.bench --plot FILE`: the run's results as a picture, the way nccl-tests
results are usually shown: time and busbw against message size, log-log, one line per system
(every column of the run). matplotlib is an optional extra (`pip install 'jacklring[plot]'`),
imported only here, only when a plot is asked for."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("bench: --plot needs matplotlib: pip install 'jacklring[plot]'") from None
    matplotlib.use("Agg")  # a file, never a window
    matplotlib.rcParams["svg.fonttype"] = "none"  # an SVG keeps its words as text (searchable)
    import matplotlib.pyplot as plt

    return plt


def plot_results(path: str | Path, results: dict, names: list[str], sizes: list[int], n: int,
                 stat: str = "median", title: str = "", size_label: Callable[[int], str] = str) -> Path:
    """Write the figure to `path` (its suffix picks the format: .png, .svg, .pdf); returns it.
    results: {(bytes, name): {"times": [seconds per round, ...], "ok": bool}} as bench gathers."""
    plt = _pyplot()
    pick = min if stat == "min" else statistics.median
    factor = 2 * (n - 1) / n if n > 1 else 1.0
    fig, (time_ax, bw_ax) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name in names:
        points = [(b, pick(results[(b, name)]["times"])) for b in sizes if (b, name) in results]
        if not points:
            continue
        xs = [b for b, _ in points]
        time_ax.plot(xs, [t * 1e6 for _, t in points], marker="o", markersize=3, label=name)
        bw_ax.plot(xs, [b / t / 1e9 * factor for b, t in points], marker="o", markersize=3, label=name)

    for ax, label in ((time_ax, f"time per all_sum, us ({stat})"), (bw_ax, "busbw, GB/s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [size_label(b) for b in sizes], rotation=45 if len(sizes) > 8 else 0)
        ax.xaxis.set_minor_locator(plt.NullLocator())  # the sizes measured are the ticks
        ax.set_xlabel("message size, bytes")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title or f"all_sum float32, {n} ranks")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_training(path: str | Path, epochs: list[int], losses: list[float], accuracies: list[float],
                  title: str) -> Path:
    """The example's curves: training loss and test accuracy per epoch, on two axes."""
    plt = _pyplot()
    fig, loss_ax = plt.subplots(figsize=(7, 4.2))
    loss_ax.plot(epochs, losses, marker="o", color="tab:blue", label="training loss")
    loss_ax.set_xlabel("epoch")
    loss_ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    loss_ax.set_ylabel("training loss", color="tab:blue")
    acc_ax = loss_ax.twinx()
    acc_ax.plot(epochs, [a * 100 for a in accuracies], marker="s", color="tab:orange", label="test accuracy")
    acc_ax.set_ylabel("test accuracy, %", color="tab:orange")
    loss_ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
