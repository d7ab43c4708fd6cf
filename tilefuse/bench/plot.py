"""One PNG per family: time per case for every implementation, and tilefuse's roofline fraction."""

from __future__ import annotations

from pathlib import Path


def plot_family(family: str, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases: list[str] = []
    for row in rows:
        label = ",".join(str(v) for k, v in row["params"].items() if k != "dtype")
        if label not in cases:
            cases.append(label)
    impls = sorted({r["impl"] for r in rows}, key=lambda s: (not s.startswith("tilefuse"), s))
    fig, (ax_t, ax_r) = plt.subplots(2, 1, figsize=(max(8, 0.22 * len(cases)), 8), sharex=True)
    for impl in impls:
        pts = [(cases.index(",".join(str(v) for k, v in r["params"].items() if k != "dtype")), r)
               for r in rows if r["impl"] == impl and r.get("median_us")]
        if not pts:
            continue
        xs = [x for x, _ in pts]
        ax_t.plot(xs, [r["median_us"] for _, r in pts], marker="o", ms=3, lw=0.8, label=impl)
        if impl.startswith("tilefuse") or impl in ("cublas_gemm", "flashmla", "fp16_cublas"):
            ax_r.plot(xs, [r.get("roofline_frac") or 0 for _, r in pts], marker="o", ms=3, lw=0.8, label=impl)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("median time (us), cold L2")
    ax_t.legend(fontsize=7, ncol=3)
    ax_r.set_ylabel("roofline fraction")
    ax_r.axhline(1.0, color="gray", lw=0.5)
    ax_r.legend(fontsize=7, ncol=3)
    ax_r.set_xticks(range(len(cases)))
    ax_r.set_xticklabels(cases, rotation=90, fontsize=6)
    ax_t.set_title(f"tilefuse bench {family}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
