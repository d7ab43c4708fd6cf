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

A family whose ``PLOT`` is a :class:`SortedRatioPlot` (``corpus``: thousands of shapes, no common
x) is drawn by :func:`plot_sorted` instead: each case's speedup over its baseline, sorted, graph and
eager, with the same axis, goal-line and title conventions.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class SortedRatioPlot:
    """A family drawn as sorted per-case speedups (:func:`plot_sorted`) rather than lines over a
    param: one column of panels per value ``panels`` of the ``panel`` param, a row for graph and
    one for eager mode; one curve per value of the ``color`` param (its values ``colors``, in
    order), dashed where the ``dashed`` param is true (a population reported apart); ``goals``
    maps a panel value to its :class:`~tilefuse.bench.harness.Goal` lines (``xs`` is ignored)."""

    panel: str
    panels: tuple
    color: str
    colors: tuple
    dashed: str | None = None
    goals: dict = field(default_factory=dict)


SORTED_MODES = (("graph", "graph_speedup"), ("eager", "eager_speedup"))


def plot_sorted(spec: SortedRatioPlot, summary: dict, path: Path, title: str) -> None:
    """Each case's speedup over its baseline (``summary["cases"]``: baseline time / tilefuse time)
    per panel and mode, on a log axis with the 1.0 line (below it: tilefuse slower than the
    baseline): per curve (a ``color`` value, solid or dashed) its cases sorted from the slowest,
    at x = their rank as a fraction of the curve's cases, so curves of a few and of thousands of
    cases read alike; a case that misses one of its own goals in that mode (``kernel_goals``
    named "<mode>: ...") gets a crimson ring."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import PercentFormatter

    colors = plt.get_cmap("tab10")
    fig, axes = plt.subplots(len(SORTED_MODES), len(spec.panels), figsize=(6.4 * len(spec.panels), 7.6),
                             squeeze=False, sharex=True)
    for c, panel in enumerate(spec.panels):
        entries = [e for e in summary["cases"] if e["params"].get(spec.panel) == panel]
        baselines = sorted({e["baseline"] for e in entries if e["baseline"]}) or ["baseline"]
        for r, (mode, key) in enumerate(SORTED_MODES):
            ax = axes[r][c]
            curves: dict = {}     # (colour value, dashed) -> [(speedup, entry)]
            for e in entries:
                if e[key]:
                    dashed = bool(spec.dashed and e["params"].get(spec.dashed))
                    curves.setdefault((e["params"].get(spec.color), dashed), []).append((e[key], e))
            ys, ringed = [], ([], [])
            order = {v: i for i, v in enumerate(spec.colors)}
            for (value, dashed), pts in sorted(curves.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1])):
                pts.sort(key=lambda p: p[0])
                xs = [(i + 0.5) / len(pts) for i in range(len(pts))]
                vs = [y for y, _ in pts]
                k = order.get(value, -1)
                ax.plot(xs, vs, color=colors(k % colors.N) if k >= 0 else "gray", lw=1.2, ls="--" if dashed else "-",
                        marker="o" if len(pts) <= 40 else None, ms=2.5)
                ys += vs
                for x, (y, e) in zip(xs, pts):
                    if _misses(e, mode):
                        ringed[0].append(x)
                        ringed[1].append(y)
            if ringed[0]:
                ax.plot(*ringed, ls="", marker="o", ms=6, mec="crimson", mfc="none", mew=0.7)
            goals = spec.goals.get(panel, []) if ys else []
            for goal in goals:
                ax.axhline(goal.y, color="crimson", lw=1.0, ls=(0, (4, 3)), alpha=0.85)
                ax.annotate(goal.label, (0.99, goal.y), xycoords=("axes fraction", "data"), xytext=(0, 2),
                            textcoords="offset points", ha="right", va="bottom", fontsize=6.5, color="crimson")
            if not ys:
                ax.text(0.5, 0.5, "not measured in this run", transform=ax.transAxes, ha="center", va="center",
                        fontsize=8, color="gray")
                ax.tick_params(axis="y", left=False, labelleft=False)
            else:
                ax.axhline(1.0, color="black", lw=0.7)
                _ratio_axis(ax, ys + [g.y for g in goals])
                ax.text(0.01, 0.98, f"{len(ys)} cases, {sum(y < 1 for y in ys)} slower than {'/'.join(baselines)}, "
                        f"{len(ringed[0])} miss a goal (ringed)", transform=ax.transAxes, ha="left", va="top",
                        fontsize=7)
            ax.set_xlim(0, 1)
            ax.xaxis.set_major_formatter(PercentFormatter(1.0))
            ax.tick_params(labelsize=7)
            ax.grid(True, which="major", lw=0.3, alpha=0.5)
            ax.set_title(f"{panel}, {mode}: {'/'.join(baselines)} {mode}_us / tilefuse {mode}_us", fontsize=8.5)
            if r == len(SORTED_MODES) - 1:
                ax.set_xlabel("share of the curve's cases, sorted by speedup", fontsize=8)

    handles = [Line2D([], [], color=colors(i % colors.N), lw=1.5, label=f"{spec.color} {v}")
               for i, v in enumerate(spec.colors)]
    if spec.dashed:
        handles.append(Line2D([], [], color="gray", lw=1.2, ls="--", label=spec.dashed.replace("_", "-")))
    handles.append(Line2D([], [], ls="", marker="o", ms=6, mec="crimson", mfc="none", label="misses a goal"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7.5, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _misses(entry: dict, mode: str) -> bool:
    """Whether a summary case misses one of its own goals in ``mode`` (goals named "<mode>: ...")."""
    return any(g["met"] is False and g["goal"].startswith(f"{mode}:") for g in entry.get("kernel_goals", []))


def _size_label(v: float) -> str:
    v = int(v)
    return f"{v // 1024}K" if v >= 1024 and v % 1024 == 0 else str(v)


def _ratio_axis(ax, values: list[float]) -> None:
    """A log y axis of speed ratios around ``values`` and 1.0, ticks labelled "2x", "0.5x"."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    lo, hi = min(values + [1.0]) / 1.15, max(values + [1.0]) * 1.25
    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    ax.yaxis.set_major_locator(FixedLocator(_ratio_ticks(lo, hi)))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))


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
    if isinstance(spec, SortedRatioPlot):
        plot_sorted(spec, summary, path, title or f"tilefuse bench {family}")
        return
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
                if ys:
                    ax.axhline(1.0, color="black", lw=0.6)
                _ratio_axis(ax, ys + [g.y for g in goals])
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
