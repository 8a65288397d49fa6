"""The `zeus-callbacks demo --plot` figure: time and energy per step against the power limit."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from zeus_callbacks.core.files import write_atomic

__all__ = ["plot"]


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Time and energy per step against the power limit, the choice marked (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(report["power_limits"], key=lambda r: r["power_limit_w"])
    pls = [r["power_limit_w"] for r in rows]
    fig, (ax_t, ax_e) = plt.subplots(2, 1, sharex=True, figsize=(6, 6))
    for ax, key, scale, unit in (
        (ax_t, "time_per_step_s", 1000, "time/step (ms)"),
        (ax_e, "energy_per_step_j", 1, "energy/step (J)"),
    ):
        ys = [scale * r[key] for r in rows]
        ax.plot(pls, ys, "-", color="tab:blue", alpha=0.5)
        for r, y in zip(rows, ys, strict=True):
            ax.plot(r["power_limit_w"], y, "o", color="tab:blue", fillstyle="none" if r["pruned"] else "full")
        ax.set_ylabel(unit)
        if report["optimal_power_limit_w"] is not None:
            ax.axvline(report["optimal_power_limit_w"], color="tab:green", linestyle="--", label="chosen")
    ax_e.set_xlabel("power limit (W)")
    ax_t.legend(loc="best", title="hollow: pruned")
    title = f"{report['gpu']}: {report['selector']}"
    if report["simulated"]:
        title = f"SIMULATED {title}"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    image = io.BytesIO()  # rendered here, written as every file of the package is (`files.write_atomic`)
    fig.savefig(image, dpi=100, format=Path(path).suffix.lstrip(".").lower() or "png")
    plt.close(fig)
    write_atomic(path, image.getvalue(), mode=0o644)
