"""Plot running sequences per actor over time, one heat-map panel per mode (Agg backend)."""
from __future__ import annotations

from collections.abc import Mapping

from batchgen_lab.sim.result import SimResult

PLOT_MODES = ("static", "migrate")


def plot_active(results: Mapping[str, SimResult], path: str, title: str = "",
                bins: int = 600) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [m for m in PLOT_MODES if m in results] or list(results)
    t_end = max(results[m].bct_s for m in shown)
    vmax = max(max((n for tr in results[m].traces for _, n in tr), default=1) for m in shown)
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 2.6 * len(shown) + 0.6), sharex=True,
                             squeeze=False)
    for ax, m in zip(axes[:, 0], shown):
        r = results[m]
        grid = r.active_grid(t_end, bins)
        im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis",
                       extent=(0, t_end, r.actors, 0), vmin=0, vmax=vmax)
        ax.axvline(r.bct_s, color="red", lw=1)
        ax.set_ylabel("actor")
        ax.set_title(f"{m}: BCT {r.bct_s:.0f} s, idle {r.idle_gpu_s:.0f} GPU-s", fontsize=10)
        fig.colorbar(im, ax=ax, label="running seqs")
    axes[-1, 0].set_xlabel("time (s)")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
