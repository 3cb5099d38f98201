"""PNG of a run: the loss curve beside the memory of one step (measured and estimated), and
`check_image_path`, the up-front check of a chart's file name (shared with the memory sweep's --png)."""

from __future__ import annotations

import os
import pathlib


def image_formats() -> tuple[str, ...]:
    """The file extensions matplotlib can save a figure as (pyplot is not imported); .pgf only where
    the LaTeX program it runs is installed."""
    import shutil

    import matplotlib
    from matplotlib.backend_bases import FigureCanvasBase

    latex = shutil.which(matplotlib.rcParams["pgf.texsystem"]) is not None
    return tuple(f for f in FigureCanvasBase.get_supported_filetypes() if f != "pgf" or latex)


def check_image_path(value: str | os.PathLike, flag: str) -> None:
    """Refuse, before the work that fills it, a chart path matplotlib cannot save: its extension
    picks the format. (A name without one is refused too: matplotlib would add '.png' to it.)
    An existing directory passes here: `jmem.io.paths.prepare_output` refuses it as such.

    Raises:
        ValueError: one line naming the flag, the path and the accepted extensions.
    """
    path = pathlib.Path(value).expanduser()
    formats = image_formats()
    if path.is_dir() or path.suffix[1:].lower() in formats:
        return
    got = f"matplotlib cannot write {path.suffix!r} files" if path.suffix else "the file name has no extension"
    raise ValueError(f"{flag} {str(value)!r}: {got}; accepted: a file name ending in "
                     f"{', '.join('.' + f for f in formats)}")


def plot_run(result, path: str, *, title: str = "") -> None:
    """Write `path`: train/eval loss by step (left), memory bars in MiB (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_l, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    steps = sorted(result.losses)
    ax_l.plot([s + 1 for s in steps], [result.losses[s] for s in steps], label="train")
    if result.eval_losses:
        ev = sorted(result.eval_losses)
        ax_l.plot(ev, [result.eval_losses[s] for s in ev], "o-", label="eval")
    ax_l.set_xlabel("step")
    ax_l.set_ylabel("loss (nats/token)")
    ax_l.legend()
    ax_l.grid(alpha=0.3)
    r = result.memory
    names = ["arguments", "temp", "outputs", "total"]
    vals = [r.argument_bytes, r.temp_bytes, r.output_bytes, r.total_bytes]
    from jmem.memory.estimate import PARAM_PARTS

    estimate = {k: v for k, v in result.estimate.items() if k not in PARAM_PARTS}  # parts of params
    names += [f"est. {k}" for k in estimate]
    vals += list(estimate.values())
    colors = ["tab:blue"] * 4 + ["tab:orange"] * len(estimate)
    ax_m.barh(names[::-1], [v / 2**20 for v in vals][::-1], color=colors[::-1])
    ax_m.set_xlabel(f"MiB per step [{r.target}] (blue: compiler, orange: analytic)")
    fig.suptitle(title)
    fig.tight_layout()
    pathlib.Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
