"""PNG plots of a bench run (matplotlib is an optional extra: without it, no plots and a
note saying so)."""
from __future__ import annotations

import os


def _plt():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def plot_load(sec: dict, path: str, plt) -> str | None:
    warm = sec.get("warm") or {}
    if not warm:
        return None
    cold = sec.get("cold") or {}
    keys = list(warm)
    labels = [warm[k]["label"] for k in keys]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(keys) + 1.6))
    y = range(len(keys))
    h = 0.38 if cold else 0.6
    wv = [warm[k]["gbps_per_rank"] for k in keys]
    ax.barh([i - (h / 2 if cold else 0) for i in y], wv, height=h, label="warm page cache",
            color="#3b75af")
    for i, v in zip(y, wv):
        ax.text(v, i - (h / 2 if cold else 0), f" {v:.2f}", va="center", fontsize=8)
    if cold:
        cv = [cold[k]["gbps_per_rank"] if k in cold else 0 for k in keys]
        ax.barh([i + h / 2 for i in y], cv, height=h, label="cold page cache", color="#ef8636")
        for i, v in zip(y, cv):
            ax.text(v, i + h / 2, f" {v:.2f}", va="center", fontsize=8)
    ax.set_yticks(list(y))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s per rank (bytes held / wall; ceiling: file bytes / wall)")
    ax.set_title(f"{os.path.basename(sec['ckpt'].rstrip('/'))}, {sec['world']} ranks at "
                 f"tp={sec['layout']['tp']}, median of {sec['repeats']}", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_plan(sec: dict, path: str, plt) -> str | None:
    rows = sec.get("rows") or []
    if len(rows) < 2:
        return None
    from matplotlib.ticker import FuncFormatter
    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    kinds: dict = {}
    for r in rows:
        kinds.setdefault(r.get("kind", "layout"), []).append(r)
    for kind, rs in kinds.items():   # plan + cover per kind of layout
        a1.plot([r["world"] for r in rs], [r["total_s"] for r in rs], "o-", label=kind)
    for world, tgt in ((r["world"], r["target_s"]) for r in rows if "target_s" in r):
        a1.plot([world], [tgt], "rx", ms=9)
        a1.annotate(f"target {tgt:g} s", (world, tgt), fontsize=7,
                    textcoords="offset points", xytext=(-40, 6))
    a1.set_xscale("log", base=2)
    a1.set_yscale("log")
    a1.yaxis.set_major_formatter(fmt)
    a1.yaxis.set_minor_formatter(fmt)
    a1.set_xlabel("ranks")
    a1.set_ylabel("seconds")
    a1.set_title("DeepSeek-V3 full metadata: plan + cover vs ranks", fontsize=9)
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)
    for kind, rs in kinds.items():
        sl = [r["slices"] for r in rs]
        a2.plot(sl, [r["total_s"] for r in rs], "o-", label=kind)
        for s, r in zip(sl, rs):
            a2.annotate(f"{r['world']}", (s, r["total_s"]), fontsize=7,
                        textcoords="offset points", xytext=(3, -9))
    a2.set_xscale("log")
    a2.set_yscale("log")
    a2.yaxis.set_major_formatter(fmt)
    a2.yaxis.set_minor_formatter(fmt)
    a2.set_xlabel("tensor slices in the plan (all ranks)")
    a2.set_ylabel("seconds")
    rates = [r["slices_per_s"] for r in rows]
    a2.set_title(f"time vs slices ({min(rates):,.0f}-{max(rates):,.0f} slices/s)", fontsize=9)
    a2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(out_dir: str, results: dict) -> tuple[list[str], str | None]:
    plt = _plt()
    if plt is None:
        return [], "matplotlib not installed: no plots (pip install 'coordloader[bench]')"
    os.makedirs(out_dir, exist_ok=True)
    made = []
    if results.get("load"):
        p = plot_load(results["load"], os.path.join(out_dir, "load_gbps.png"), plt)
        if p:
            made.append(p)
    if results.get("plan"):
        p = plot_plan(results["plan"], os.path.join(out_dir, "plan_scaling.png"), plt)
        if p:
            made.append(p)
    return made, None
