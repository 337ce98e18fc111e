"""The ``decisiond eval`` report as people read it: the markdown tables (every mode with its intervals, each fitted
mode beside its base with the fold-to-fold spread, then per question type) and the reliability diagram. The numbers
are ``decisiond.evaluation``'s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .evaluation import ALL_MODES, FIT, INTERVAL_METRICS, KINDS, MODES, REFERENCE


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Reliability diagram (each point labeled with its bin's count) over a panel of the bins' counts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, counts) = plt.subplots(2, 1, figsize=(7, 9), dpi=100, height_ratios=(3, 1), sharex=True)
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfectly calibrated")
    for mode, rows in report["reliability"].items():
        if not rows:
            continue
        fitted = mode.endswith(FIT)  # drawn dotted, in its base mode's colour
        style = {"color": f"C{list(MODES).index(mode[: -len(FIT)] if fitted else mode)}",
                 "linestyle": ":" if fitted else "-"}
        x = [r["confidence"] for r in rows]
        ax.plot(x, [r["accuracy"] for r in rows], marker="o", **style,
                label=f"{mode} (ECE {report['modes'][mode]['all']['ece']:.3f})")
        for r in rows:
            ax.annotate(str(r["count"]), (r["confidence"], r["accuracy"]), textcoords="offset points",
                        xytext=(4, 3), fontsize=6, color=style["color"])
        counts.plot(x, [r["count"] for r in rows], marker=".", **style)
    ax.set_ylabel("accuracy")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title(f"Reliability: {report['model']}, {report['questions']} questions\n(numbers: questions per bin; "
                 f"dotted: +fit)", fontsize=10)
    ax.legend(loc="upper left", fontsize=7)
    counts.set_xlabel("top probability (bin mean)")
    counts.set_ylabel("questions in bin")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _ci(values: list[float], signed: bool = False) -> str:
    fmt = "{:+.3f}" if signed else "{:.3f}"
    return f"[{fmt.format(values[0])}, {fmt.format(values[1])}]"


def table(report: dict[str, Any]) -> str:
    """Markdown: every mode overall with 95% intervals and the paired difference against raw, then per type."""
    t, c, best = report["threshold"], report["coverage"], report["best_mode"]
    ref = f"vs_{REFERENCE}"

    def label(mode: str) -> str:
        return f"**{mode}** ★" if mode == best else mode

    lines = [f"| mode | questions | accuracy [95% CI] | log loss [95% CI] | ECE [95% CI] | Δ accuracy vs {REFERENCE} "
             f"| Δ log loss vs {REFERENCE} | Δ ECE vs {REFERENCE} |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode in ALL_MODES:
        m = report["modes"][mode]["all"]
        r = report["modes"][REFERENCE]["all"]
        cells = [f"{m[k]:.3f} {_ci(m['interval'][k])}" for k in INTERVAL_METRICS]
        cells += [f"{m[k] - r[k]:+.3f} {_ci(m[ref][k], signed=True)}" for k in INTERVAL_METRICS]
        lines.append(f"| {label(mode)} | {m['n']} | " + " | ".join(cells) + " |")
    lines += ["", f"★ lowest log loss (cross-validated for +fit modes). Intervals: bootstrap over "
                  f"{report['items']} items, {report['bootstrap']['resamples']} resamples, seed "
                  f"{report['bootstrap']['seed']}.", "", *beside_base(report), "",
              f"| mode | questions | accuracy | log loss | Brier | ECE | answered at p ≥ {t:g} "
              f"| accuracy when answered | accuracy at coverage {c:g} |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for scope in ("all", *KINDS):
        for mode in ALL_MODES:
            m = report["modes"][mode][scope]
            if not m.get("n"):
                continue
            name = label(mode) if scope == "all" else f"{mode} — {scope}"
            lines.append(f"| {name} | {m['n']} | {m['accuracy']:.3f} | {m['log_loss']:.3f} | {m['brier']:.3f} | "
                         f"{m['ece']:.3f} | {m['answered']:.2f} | {m['answered_accuracy']:.3f} | "
                         f"{m['coverage_accuracy']:.3f} |")
    return "\n".join(lines)


def beside_base(report: dict[str, Any]) -> list[str]:
    """Markdown: each fitted mode beside its base mode, fold by fold (each outer fold scored by fits on the others):
    the held-out log loss of both and the spread of the difference."""
    lines = ["| fitted mode | base log loss | +fit log loss | Δ log loss per fold: mean ± sd [min, max] "
             "| folds where the fit lost | folds that kept a fit, per type |", "|---|---:|---:|---:|---:|---|"]
    for mode in MODES:
        fit = report["fits"][mode + FIT]
        base_loss = report["modes"][mode]["all"]["log_loss"]
        fitted_loss = report["modes"][mode + FIT]["all"]["log_loss"]
        kept = ", ".join(f"{kind} {sum(s is not None for s in chosen)}/{len(chosen)}"
                         for kind, chosen in fit["strengths"].items())
        lines.append(f"| {mode + FIT} | {base_loss:.3f} | {fitted_loss:.3f} | {fit['delta_mean']:+.3f} ± "
                     f"{fit['delta_sd']:.3f} [{fit['delta_min']:+.3f}, {fit['delta_max']:+.3f}] | "
                     f"{fit['folds_worse']}/{len(fit['folds'])} | {kept} |")
    return lines

