"""The arena sweep's picture: decode and prefill tok/s against context, one line per system
and arena, from bench_sweep.py's JSON rows (the newest commit's)."""
from __future__ import annotations

import json

from bench_util import log


def latest_rows(rows: list[dict]) -> list[dict]:
    """The sweep rows of the newest row's commit, the newest per system/arena/context/KV."""
    rows = [r for r in rows if r.get("kind") == "sweep"]
    keep = {(r["system"], str(r["arena_mib"]), r["ctx"], r["kv_type"]): r
            for r in rows if r.get("commit") == rows[-1].get("commit")}
    return list(keep.values())


def plot_rows(rows: list[dict], path: str) -> None:
    """Decode and prefill tok/s against context, one line per system and arena; dashed:
    each streamed arena's PCIe bound."""
    if not rows:
        raise SystemExit("no sweep rows to plot")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lines: dict[str, list] = {}
    for r in sorted(rows, key=lambda r: r["ctx"]):
        a, used = r["arena_mib"], r["arena_mib_used"]
        arena = ("" if a is None else f" arena {a:g} MiB" if a != "auto" else
                 " arena auto (" + (f"{used:g} MiB)" if used else "all resident)"))
        lines.setdefault(f"{r['system']}{arena}, KV {r['kv_type']}", []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(14, 7))
    ctxs = sorted({r["ctx"] for r in rows})
    # one colour a line in both panels (a peer without prefill figures skips one there)
    colour = {name: f"C{i}" for i, name in enumerate(lines)}
    for ax, key in zip(axes, ("decode_tok_s", "prefill_tok_s")):
        for name, rs in lines.items():
            pts = [(r["ctx"], r[key]) for r in rs if r.get(key)]
            bpts = [(r["ctx"], r["bound_tok_s"]) for r in rs if r["system"] == "kvcompile"
                    and r.get("bound_kind") == "pcie" and key == "decode_tok_s"]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name, color=colour[name])
            if pts and bpts:
                ax.plot(*zip(*bpts), ls="--", color=colour[name], alpha=0.6,
                        label=f"PCIe bound, arena {rs[0]['arena_mib_used']:g} MiB")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ctxs, [f"{c // 1024}K" if c >= 1024 else str(c) for c in ctxs])
        ax.set_xticks([], minor=True)
        ax.set(xlabel="context (tokens)", ylabel="tok/s", title="decode tok/s" if key[0] == "d"
               else "prefill tok/s (prompt to first token)")
        ax.grid(True, which="major", alpha=0.3)
    r0 = rows[0]
    fig.suptitle(f"{r0.get('geometry', '')} on {r0.get('device')}, commit "
                 f"{str(r0.get('commit'))[:8]}, {str(r0.get('date'))[:10]}", fontsize=10)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.02 + 0.03 * -(-len(axes[0].lines) // 3), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"plot: {path} ({len(rows)} rows)")


def load(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)["rows"]
