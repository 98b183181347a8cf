"""How much slower one request's work runs after a pause, on this machine.

Issue 38's item 3(b) asks that ctxgate add at most 2 ms over a bare relay when the upstream
answers 200 ms late: the gateway's work before the forward and after the reply then runs after
a pause. This measures, in one process and with no server, a fixed piece of that work done
back to back, and again after a pause of 1 to 200 ms, either sleeping or spinning on a loop
that touches no memory (so the CPU never idles). Two workloads, each timed on its own:

- `gateway`: ctxgate's own pieces for a new ~1K-token chat conversation: parse the body
  (orjson), check it with the chat door's validators, take each message's fingerprint, append
  a USER_INPUT line for each and then a RESPONSE line to a session's WAL file (`wal.writer.WalWriter`,
  a real file), and encode a reply;
- `json`: what any proxy that reads its bodies does: parse the same body and encode it again.

Each (pause, how) runs `--rounds` times in a shuffled order; the table gives the p50 of each
workload and its ratio to the back-to-back p50. A ratio far above 1 at 200 ms, spinning as
sleeping, means the work runs cold after a wait, whatever it waits on (lost caches, or the
virtual machine's scheduling: this cannot tell them apart).

    .venv/bin/python bench/cold_cache.py [--rounds 40] [--pauses 1,10,50,200] [--out FILE]
"""
from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import common  # sets LITELLM_LOCAL_MODEL_COST_MAP first
import doors
import orjson

from ctxgate.pipeline.fingerprint import message_fingerprint
from ctxgate.proxy.doors.validation import validate_chat_messages, validate_chat_request
from ctxgate.wal.paths import WalPaths
from ctxgate.wal.writer import WalWriter

REPLY = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "gpt-4o",
         "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
         "usage": {"prompt_tokens": 1000, "completion_tokens": 1, "total_tokens": 1001}}


def workloads(body: bytes, writer: WalWriter) -> dict[str, Callable[[], None]]:
    turn = [0]

    def gateway() -> None:
        turn[0] += 1
        parsed = orjson.loads(body)
        validate_chat_request(parsed)
        messages = parsed["messages"]
        validate_chat_messages(messages, 0)
        prints = [message_fingerprint(m) for m in messages]
        events = [{"type": "USER_INPUT", "turn": turn[0], "fingerprint": fp, "role": m.get("role")}
                  for fp, m in zip(prints, messages)]
        writer.append("bench", "cold", events)
        writer.append("bench", "cold", [{"type": "RESPONSE", "turn": turn[0], "status": 200}])
        orjson.dumps(REPLY)

    def json_only() -> None:
        orjson.dumps(orjson.loads(body))

    return {"gateway": gateway, "json": json_only}


def pause(how: str, seconds: float) -> None:
    if how == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def timed(work: Callable[[], None]) -> float:
    started = time.perf_counter()
    work()
    return (time.perf_counter() - started) * 1000


def main() -> None:
    p = common.parser(__doc__, wait=120)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--pauses", default="1,10,50,200", help="pauses in ms, besides back to back")
    args = p.parse_args()
    common.wait_for_quiet(max_wait_s=args.max_wait)
    conversation = common.build_conversation(1000, common.gpt4o_counter())
    body = doors.DOORS["chat"].payload(common.fresh(conversation, "cold"))
    cases = [("back to back", 0.0)] + [(how, float(ms)) for ms in args.pauses.split(",") for how in ("sleep", "spin")]
    times: dict[tuple[str, float, str], list[float]] = {}
    rng = random.Random(7)
    with tempfile.TemporaryDirectory() as tmp:
        writer = WalWriter(WalPaths(Path(tmp)))
        work = workloads(body, writer)
        for name in work:  # warm-up: imports, the WAL file opened
            for _ in range(5):
                work[name]()
        for r in range(args.rounds):
            order = [(how, ms, name) for how, ms in cases for name in work]
            rng.shuffle(order)
            for how, ms, name in order:
                if ms:
                    pause(how, ms / 1000)
                else:
                    work[name]()  # back to back: right after the same work
                times.setdefault((how, ms, name), []).append(timed(work[name]))
            if (r + 1) % 10 == 0:
                common.progress(f"  round {r + 1}/{args.rounds}")
        writer.close()
    base = {name: statistics.median(times[("back to back", 0.0, name)]) for name in work}
    rows = []
    for how, ms in cases:
        row: list[object] = [f"{ms:g}" if ms else "0", how]
        for name in work:
            p50 = statistics.median(times[(how, ms, name)])
            row += [f"{p50:.3f}", f"{p50 / base[name]:.1f}×"]
        rows.append(row)
    text = "\n".join([
        common.section_header("Cold caches: one request's work after a pause"), "", common.about(__doc__), "",
        f"Body: {len(body):,} bytes, {len(orjson.loads(body)['messages'])} messages; {args.rounds} rounds.", "",
        common.table(["pause ms", "how", "gateway p50 ms", "÷ back to back", "json p50 ms", "÷ back to back"], rows,
                     "llrrrr"),
    ])
    common.publish("cold-cache", text, args.out)


if __name__ == "__main__":
    main()
