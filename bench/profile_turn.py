"""Where a turn's time goes inside ctxgate: py-spy samples the running server while a client
drives steady turns (or new conversations) of a given size, and the top of the profile is
written to RESULTS.md, for this checkout and, with `--before`, another one side by side.

    .venv/bin/python bench/profile_turn.py --size 200K --door chat
    git worktree add /tmp/ctxgate-before <commit>
    .venv/bin/python bench/profile_turn.py --size 200K --before /tmp/ctxgate-before

`--before DIR` runs the server from another checkout of this repository (its folders put on
PYTHONPATH under the `ctxgate` name, ahead of the installed package), then this one, on the
same machine in the same run. Percentages are of all samples of the server process (idle
time included: the client and the upstream run on the same cores); the X-Ctx-Overhead-Ms
median is the server's own figure for the same turns.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

import common  # noqa: E402  (sets LITELLM_LOCAL_MODEL_COST_MAP first)
import doors
from overhead import parse_size, size_label

OWN_FRAMES = ("proxy/", "pipeline/", "memory/", "wal/")


def _server_env(source: Path | None, workdir: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    if source is not None:
        shim = workdir / "pkg"
        shim.mkdir()
        (shim / "ctxgate").symlink_to(source.resolve())
        env["PYTHONPATH"] = str(shim)
    return env


def _messages(base: list[dict[str, Any]], kind: str, i: int) -> list[dict[str, Any]]:
    if kind == "conv":
        return [{**m, "content": f"<{i}> " + (m.get("content") or "")} for m in base]
    extra = [m for j in range(i + 1) for m in ({"role": "assistant", "content": "ok"},
                                              {"role": "user", "content": f"Next step {j}: go on."})]
    return base + extra


async def _drive(url: str, door: doors.Door, base: list[dict[str, Any]], kind: str, turns: int, tag: str,
                 first: int = 0) -> list[float]:
    overheads = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for i in range(first, first + turns):
            headers = door.headers(common.UPSTREAM_KEY)
            headers["X-Ctx-Session"] = f"{tag}-{i if kind == 'conv' else 0}"
            async with http.post(url + door.path, data=door.payload(_messages(base, kind, i)), headers=headers) as r:
                body = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {body[:300]!r}")
                overheads.append(float(r.headers["X-Ctx-Overhead-Ms"]))
    return overheads


def _top(raw: Path, n: int) -> tuple[int, list[tuple[str, float]]]:
    """(samples, [(frame, inclusive share)]) for ctxgate's own frames, largest first."""
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        total += int(count)
        # By function (`name (file)`): a function's lines together, each once per sample.
        functions = {frame.rsplit(":", 1)[0] + ")" for frame in stack.split(";")}
        for function in functions:
            if any(own in function for own in OWN_FRAMES) and "cli.py" not in function:
                inclusive[function] += int(count)
    return total, [(f, c / max(1, total)) for f, c in inclusive.most_common(n)]


def profile(name: str, source: Path | None, args: argparse.Namespace, base: list[dict[str, Any]]) -> dict[str, Any]:
    with common.Servers("ctxgate-profile-") as servers:
        workdir = servers.workdir
        upstream = servers.upstream().url
        server = servers.ctxgate(common.ctxgate_config(upstream, workdir, data_dir=str(workdir / "data")),
                                 env=_server_env(source, workdir))
        door = doors.DOORS[args.door]
        tag = f"profile-{os.getpid()}-{len(name)}"
        asyncio.run(_drive(server.url, door, base, args.kind, 10, tag))  # warm-up: tokenizer, pools, caches
        raw = workdir / "profile.txt"
        spy = subprocess.Popen([str(common.VENV_BIN / "py-spy"), "record", "--pid", str(server.popen.pid),
                                "--format", "raw", "--rate", str(args.rate), "--output", str(raw)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        overheads = asyncio.run(_drive(server.url, door, base, args.kind, args.turns, tag, first=10))
        spy.send_signal(2)
        spy.wait(30)
        samples, top = _top(raw, args.top)
        return {"name": name, "overhead_p50": statistics.median(overheads), "samples": samples, "top": top}


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--size", default="200K", help="conversation size in tokens (1K = 1,000)")
    parser.add_argument("--door", default="chat", choices=sorted(doors.DOORS))
    parser.add_argument("--kind", default="turn", choices=("turn", "conv"),
                        help="turn: steady turns of one session; conv: a new conversation each time")
    parser.add_argument("--turns", type=int, default=150, help="profiled requests")
    parser.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=15, help="frames shown")
    parser.add_argument("--before", type=Path, help="another checkout, profiled first in the same run")
    args = parser.parse_args()
    if shutil.which("py-spy", path=str(common.VENV_BIN)) is None:
        sys.exit("py-spy is not installed: make bench installs it (the bench extra)")
    size = parse_size(args.size)
    base = common.build_conversation(size, common.gpt4o_counter())
    runs = []
    if args.before is not None:
        common.progress(f"profile: {args.before} ({args.kind}, {size_label(size)}, {args.door})")
        runs.append(profile(f"before ({args.before.name})", args.before, args, base))
    common.progress(f"profile: this checkout ({args.kind}, {size_label(size)}, {args.door})")
    runs.append(profile("this checkout", None, args, base))
    what = "steady turns of one session" if args.kind == "turn" else "new conversations"
    text = common.section_header(f"Profile: {what} at {size_label(size)} tokens, {args.door} door")
    text += (f"\npy-spy at {args.rate} Hz over {args.turns} requests after 10 warm-up ones; each frame's share of "
             "all samples of the server process (inclusive, ctxgate's own frames only).\n")
    for run in runs:
        text += (f"\n### {run['name']}: X-Ctx-Overhead-Ms p50 {run['overhead_p50']:.2f} ms, "
                 f"{run['samples']} samples\n\n")
        text += common.table(["frame", "share"], [[f"`{f}`", f"{s * 100:.1f}%"] for f, s in run["top"]]) + "\n"
    common.publish(f"profile-{args.kind}-{args.door}", text, args.out)


if __name__ == "__main__":
    main()
