"""``mp-bridge demo --plot``: the loss curves of the distributed and single-process runs."""

from __future__ import annotations

import os

__all__ = ["check_plot_target", "plot_losses"]


def check_plot_target(path: str) -> None:
    """``--plot`` needs matplotlib and a writable folder: check before training, not after."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib; install the viz extra: pip install 'mp_bridge[viz]'"
        ) from None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"--plot {path}: folder {folder} does not exist or is not writable")


def plot_losses(report, path: str) -> None:
    """A PNG at ``path`` of both loss curves of a :class:`~mp_bridge.models.ParityReport`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(report.ref_losses) + 1)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, report.ref_losses, "o-", label="single process (oracle)")
    ax.plot(steps, report.dist_losses, "x--", label=f"{report.encoder} -> {report.llm}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("colocated MIMO: distributed vs single-process loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
