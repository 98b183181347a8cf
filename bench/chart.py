"""Draw bench/overhead.png from bench/overhead.json (written by bench/overhead.py): the
added p50 latency over a direct call against the request size (log x), ctxgate
(`forwarding: auto`) and the LiteLLM proxy, one line per (door, target); new
conversations on the left, steady-state turns on the right. matplotlib comes from the
`bench` extra.

    .venv/bin/python bench/chart.py [--json bench/overhead.json] [--out bench/overhead.png]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import orjson

BENCH = Path(__file__).resolve().parent
TARGETS = {"ctxgate forwarding=auto": "ctxgate", "LiteLLM proxy": "LiteLLM proxy"}
DOOR_COLOURS = {"chat": "tab:blue", "chat-stream": "tab:cyan", "messages": "tab:orange", "messages-stream": "tab:red",
                "responses": "tab:green", "responses-stream": "tab:olive"}


def _target(name: str) -> str | None:
    return next((short for prefix, short in TARGETS.items() if name.startswith(prefix)), None)


def draw(json_path: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = orjson.loads(Path(json_path).read_bytes())
    rows = data["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
    for ax, kind, title in zip(axes, ("fresh", "turn"), ("new conversation", "steady-state next turn")):
        lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in rows:
            short = _target(r["target"])
            if r["kind"] == kind and short:
                lines.setdefault((r["door"], short), []).append((r["tokens"], r["added_p50_ms"]))
        for (door, short), pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if short == "ctxgate" else "s",
                    linestyle="-" if short == "ctxgate" else "--", color=DOOR_COLOURS.get(door, "grey"),
                    label=f"{short}, {door}")
        ax.set_xscale("log")
        ax.set_title(f"{title}")
        ax.set_xlabel("request size, tokens (o200k_base)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("added latency over a direct call, p50 ms")
    axes[1].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"Added p50 latency vs size: ctxgate (solid) vs LiteLLM proxy (dashed), {data.get('date', '')}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=str(BENCH / "overhead.json"))
    p.add_argument("--out", default=str(BENCH / "overhead.png"))
    args = p.parse_args()
    draw(Path(args.json), Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
