"""The PNG of ``kvh demo``: kvh's tier occupancy over time and every
configuration's per-token latency (needs matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from .configs import SetupResult

__all__ = ["write_plot"]


def write_plot(path: Path, results: Dict[str, SetupResult], restart: Optional[Dict[str, Any]]) -> Optional[Path]:
    """PNG: kvh's tier occupancy over time (caching the library, then the
    agents' requests) and per-token latency of every configuration."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    k = results["kvh"]
    colors = {"kvh": "tab:blue", "monolithic": "tab:green", "sync-offload": "tab:red"}
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7.5))
    if k.timeline:
        t = [x[0] for x in k.timeline]
        for i, (name, color) in enumerate((("device", "tab:green"), ("host", "tab:orange"), ("disk", "tab:blue"))):
            ax1.step(t, [x[i + 1] for x in k.timeline], where="post", label=f"{name} used", color=color)
        cap = k.tiers_end.get("device", {}).get("capacity_blocks")
        if cap:
            ax1.axhline(cap, color="tab:green", linestyle=":", linewidth=1, label="device capacity")
        tr = ax1.get_xaxis_transform()
        ax1.axvspan(0, k.phase_offset, color="tab:purple", alpha=0.08)
        ax1.text(0.01 * max(t), 0.95, "caching the library", transform=tr, fontsize=8, va="top")
        for q in k.requests:
            a, b = k.phase_offset + q.t_start, k.phase_offset + q.t_end
            ax1.axvspan(a, b, color="grey", alpha=0.05 + 0.05 * (q.agent % 3))
            ax1.text(a, 0.95, f"a{q.agent}", transform=tr, fontsize=7, va="top")
    ax1.set_xlabel("seconds since the kvh engine opened")
    ax1.set_ylabel("blocks")
    ax1.set_title("kvh tier occupancy")
    ax1.legend(loc="center right", fontsize=8)
    for name, r in results.items():
        xs, ys = [], []
        for q in r.requests:
            tt = q.t_first
            for dt in q.itl_s:
                tt += dt
                xs.append(tt)
                ys.append(dt * 1e3)
        col = colors.get(name)
        ax2.plot(xs, ys, ".", markersize=3, alpha=0.7, color=col, label=f"{name}: inter-token")
        ax2.plot(
            [q.t_first for q in r.requests],
            [q.ttft_s * 1e3 for q in r.requests],
            "o",
            markersize=7,
            markerfacecolor="none",
            color=col,
            label=f"{name}: first token",
        )
    if restart and "ttft_disk_ms" in restart:
        ax2.axhline(
            restart["ttft_disk_ms"],
            color="tab:blue",
            linestyle="--",
            linewidth=1,
            label="returning agent, prefix from disk",
        )
        ax2.axhline(
            restart["ttft_recompute_ms"],
            color="black",
            linestyle="--",
            linewidth=1,
            label="returning agent, recomputed",
        )
    ax2.set_yscale("log")
    ax2.set_xlabel("seconds since the first request (each configuration's own run)")
    ax2.set_ylabel("ms")
    ax2.set_title("latency: inter-token (dots), time to first token (rings)")
    ax2.legend(loc="upper right", fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
