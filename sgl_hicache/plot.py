"""Plots of a replay report: hit rate per tier over time, TTFT distribution per policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TIER_COLORS = {"device": "#2a9d8f", "host": "#e9c46a", "disk": "#e76f51"}


def plot_report(result: dict[str, Any], out: Path) -> None:
    """Write a PNG with one stacked hit-rate-over-time panel per policy and one TTFT CDF panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = result["policies"]
    n = len(policies)
    fig, axes = plt.subplots(1, n + 1, figsize=(4.2 * (n + 1), 3.6), squeeze=False)
    for ax, (name, rep) in zip(axes[0], policies.items()):
        tl = rep.get("timeline") or []
        xs = [p["request"] for p in tl]
        ys = [[p[t] * 100 for p in tl] for t in ("device", "host", "disk")]
        if xs:
            ax.stackplot(
                xs,
                *ys,
                labels=["device", "host", "disk"],
                colors=[TIER_COLORS[t] for t in ("device", "host", "disk")],
                alpha=0.9,
            )
        ax.set_title(f"{name}: hit rate {100 * rep['hit_rate']:.1f}%")
        ax.set_xlabel("requests")
        ax.set_ylabel("prompt tokens hit (%)")
        ax.set_ylim(0, 100)
        ax.legend(loc="upper left", fontsize=8)
    ax = axes[0][n]
    for name, rep in policies.items():
        samples = sorted(rep.get("ttft_samples_s") or [])
        if samples:
            ax.plot(
                samples,
                [(i + 1) / len(samples) for i in range(len(samples))],
                label=f"{name} (p50 {rep['ttft_s']['p50']:.2f}s)",
            )
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT distribution")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
