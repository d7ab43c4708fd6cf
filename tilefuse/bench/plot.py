"""One PNG per family, drawn from its summary's ``cases``: how much faster tilefuse is than its
baseline, in eager mode and in graph mode, side by side.

Columns of panels:

1. eager: baseline ``eager_us`` / tilefuse ``eager_us`` (speedup of back-to-back eager calls);
2. graph: baseline ``graph_us`` / tilefuse ``graph_us`` (speedup of the kernels, CUDA-graph replay);
3. host cost: tilefuse ``eager_us`` / its own ``graph_us`` (1 = no host overhead);
4. roofline fraction from ``graph_us``, where the family's spec says it means something.

One line per shape family (the spec's ``line`` params; ``style`` picks the line style) over the
spec's ``x`` param on a log axis, one row of panels per value of ``facet``; the goals are dashed red
reference lines, drawn where they apply.
"""

from __future__ import annotations

import importlib
from pathlib import Path

PANELS = (
    ("eager", "eager_speedup", "eager: {baseline} eager_us / tilefuse eager_us"),
    ("graph", "graph_speedup", "graph: {baseline} graph_us / tilefuse graph_us"),
    ("host", "eager_over_graph", "host cost: tilefuse eager_us / its own graph_us"),
    ("roofline", "roofline_frac", "roofline fraction (from graph_us)"),
)
LINE_STYLES = ("-", "--", ":", "-.")
FINE_TICKS = (0.5, 0.6, 0.7, 0.8, 0.9, 1, 1.1, 1.25, 1.5, 1.75, 2)
COARSE_TICKS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 3, 5, 10, 20, 50, 100, 200,
                500, 1000)


def _size_label(v: float) -> str:
    v = int(v)
    return f"{v // 1024}K" if v >= 1024 and v % 1024 == 0 else str(v)


def _ratio_ticks(lo: float, hi: float) -> list[float]:
    """Readable ticks of a log-scale ratio axis from lo to hi: fine steps over a narrow range."""
    return [t for t in (FINE_TICKS if hi / lo < 3 else COARSE_TICKS) if lo <= t <= hi]


def _key(params: dict, names: tuple[str, ...]) -> tuple:
    return tuple(params[n] for n in names)


def _applies(goal, baselines: set) -> bool:
    named = lambda prefix: any(b and b.startswith(prefix) for b in baselines)  # noqa: E731  (flashmla@main counts as flashmla)
    return (goal.vs is None or named(goal.vs)) and (goal.not_vs is None or not named(goal.not_vs))


def plot_family(family: str, summary: dict, path: Path, title: str | None = None) -> None:
    """Draw ``summary["cases"]`` of ``family`` (its module's ``PLOT`` spec) into the PNG ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    spec = importlib.import_module(f"tilefuse.bench.{family}").PLOT
    entries = [e for e in summary["cases"] if isinstance(e["params"].get(spec.x), (int, float))]
    skipped = len(summary["cases"]) - len(entries)
    facets = list(dict.fromkeys(e["params"].get(spec.facet) if spec.facet else None for e in entries)) or [None]
    lines = list(dict.fromkeys(_key(e["params"], spec.line) for e in entries))
    styles = list(dict.fromkeys(e["params"][spec.style] for e in entries)) if spec.style else [None]
    colors = plt.get_cmap("tab10" if len(lines) <= 10 else "tab20")
    xs = sorted({e["params"][spec.x] for e in entries}) or [1]
    baselines = sorted({e["baseline"] for e in entries if e["baseline"]}) or ["baseline"]

    drawn_lines: set = set()
    fig, axes = plt.subplots(len(facets), len(PANELS), figsize=(4.4 * len(PANELS), 3.1 * len(facets) + 1.5),
                             squeeze=False, sharex=True)
    for r, facet in enumerate(facets):
        rows = [e for e in entries if not spec.facet or e["params"].get(spec.facet) == facet]
        for c, (panel, key, heading) in enumerate(PANELS):
            ax = axes[r][c]
            ys, drawn_vs = [], {e["baseline"] for e in rows if e[key]}
            for i, line in enumerate(lines):
                for j, style in enumerate(styles):
                    pts = sorted((e["params"][spec.x], e[key]) for e in rows
                                 if _key(e["params"], spec.line) == line and e[key]
                                 and (style is None or e["params"][spec.style] == style)
                                 and (panel != "roofline" or spec.roofline_if(e["params"])))
                    if pts:
                        ax.plot(*zip(*pts), marker="o", ms=3.5, lw=1.2, color=colors(i % colors.N),
                                ls=LINE_STYLES[j % len(LINE_STYLES)])
                        ys += [y for _, y in pts]
                        drawn_lines.add(i)
            if not ys:
                ax.text(0.5, 0.5, "not measured in this run", transform=ax.transAxes, ha="center", va="center",
                        fontsize=8, color="gray")
                ax.tick_params(axis="y", left=False, labelleft=False)
            goals = [g for g in spec.goals.get(panel, []) if ys and _applies(g, drawn_vs)]
            for goal in goals:
                lo, hi = goal.xs or (xs[0], xs[-1])
                ax.plot([lo / 1.3, hi * 1.3], [goal.y, goal.y], color="crimson", lw=1.0, ls=(0, (4, 3)), alpha=0.85)
                # the label ends where the line ends, except beside a one-point line away from the edge
                flush_right = lo < hi or hi >= xs[-1]
                ax.annotate(goal.label, (hi * 1.3, goal.y), xytext=(-3 if flush_right else 0, 2),
                            textcoords="offset points", ha="right" if flush_right else "left", va="bottom",
                            fontsize=6.5, color="crimson")
            if panel == "roofline":
                ax.set_ylim(0, 1.05)
            else:
                lo, hi = min(ys + [g.y for g in goals] + [1.0]), max(ys + [g.y for g in goals] + [1.0])
                if ys:
                    ax.axhline(1.0, color="black", lw=0.6)
                ax.set_yscale("log")
                ax.set_ylim(lo / 1.15, hi * 1.25)
                ax.yaxis.set_major_locator(FixedLocator(_ratio_ticks(lo / 1.15, hi * 1.25)))
                ax.yaxis.set_minor_locator(NullLocator())
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
            ax.set_xscale("log")
            ax.set_xlim(xs[0] / 1.4, xs[-1] * 1.4)
            ax.xaxis.set_major_locator(FixedLocator(xs))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _size_label(v)))
            ax.tick_params(labelsize=7)
            ax.grid(True, which="major", lw=0.3, alpha=0.5)
            if r == 0:
                ax.set_title(heading.format(baseline="/".join(baselines)), fontsize=8.5)
            if r == len(facets) - 1:
                ax.set_xlabel(spec.x, fontsize=8)
            if c == 0 and spec.facet:
                ax.set_ylabel(f"{spec.facet} = {facet}", fontsize=8.5)

    handles = [Line2D([], [], color=colors(i % colors.N), marker="o", ms=3.5,
                      label=" ".join(f"{n}={v}" for n, v in zip(spec.line, line)))
               for i, line in enumerate(lines) if i in drawn_lines]
    if spec.style:
        handles += [Line2D([], [], color="gray", ls=LINE_STYLES[j % len(LINE_STYLES)], label=f"{spec.style}={s}")
                    for j, s in enumerate(styles)]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 9), fontsize=7.5, frameon=False)
    notes = []
    if skipped:
        notes.append(f"{skipped} case(s) with a non-numeric {spec.x} are in the JSON summary only")
    if any(e.get("legacy_schema") for e in summary["cases"]):
        notes.append("older results file: eager_us not measured, graph_us only where it was timed")
    fig.suptitle((title or f"tilefuse bench {family}") + ("\n" + "; ".join(notes) if notes else ""), fontsize=10)
    fig.tight_layout(rect=(0, 0.35 / (3.1 * len(facets) + 1.5), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
