"""`ctxgate replay FILE…`: recorded sessions through the real pipeline, a table, a report."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ctxgate.pipeline.tokens import TokenCounter
from ..config import Config, ConfigError, load_config
from ..errors import GatewayError
from .driver import Message, Replay, agent_turns, replay
from .formats import FORMATS, FormatError, Recording, read_recordings
from .models import Models
from .report import write_report
from .results import SessionResult, Setting, session_result
from .summaries import Summarizer
from .table import results_table
from .upstream import ProviderCount

PROFILES = ("minimal", "professional", "enterprise")


def add_command(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("replay", help="replay recorded agent sessions through the pipeline, offline, with a report",
                       description="Replays recorded agent sessions turn by turn through ctxgate's compaction, "
                                   "in process and with no upstream, then prints a table and writes an HTML report.")
    p.add_argument("files", nargs="+", metavar="FILE", help="recorded sessions (format detected from content)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--budget", type=int, metavar="N", help="the context limit, in tokens")
    size.add_argument("--ratio", type=float, metavar="R",
                      help="the context limit as a share of each session's largest request (0.5: half of it)")
    p.add_argument("--profile", choices=PROFILES, default=None, help="pipeline profile (default: the config's)")
    p.add_argument("--config", default=os.environ.get("CTXGATE_CONFIG"),
                   help="YAML config: model_list and ctxgate: settings (env CTXGATE_CONFIG)")
    p.add_argument("--out", default="ctxgate-replay", metavar="DIR", help="where the report goes (./ctxgate-replay)")
    p.add_argument("--format", choices=sorted(FORMATS), default=None, help="the files' format (default: detected)")
    p.add_argument("--enforce-limit", action="store_true",
                   help="the upstream refuses a request over the limit; ctxgate compacts reactively and sends again, "
                        "as the gateway does")
    p.add_argument("--upstream-scale", type=float, default=1.0, metavar="F",
                   help="the upstream counts F times ctxgate's count (1: the same), as a provider whose tokenizer "
                        "ctxgate only estimates")
    p.add_argument("--model", default=None, metavar="M",
                   help="the model (limit, tokenizer, prices, summaries); default: the config's first, else "
                        "the one the recording names, else gpt-4o")


def _fail(message: str) -> int:
    print(f"ctxgate replay: {message}", file=sys.stderr)
    return 2


def _named(recordings: list[tuple[str, str, Recording]]) -> list[tuple[str, str, Recording]]:
    """Unique session names: a name met again (tau-bench repeats tasks over trials) gets `#k`."""
    seen: Counter[str] = Counter()
    out = []
    for path, fmt, r in recordings:
        k = seen[r.name]
        seen[r.name] += 1
        out.append((path, fmt, r if k == 0 else replace(r, name=f"{r.name}#{k}")))
    return out


def run(args: argparse.Namespace) -> int:
    if args.budget is not None and args.budget <= 0:
        return _fail("--budget must be a positive number of tokens")
    if args.ratio is not None and not 0 < args.ratio <= 10:
        return _fail("--ratio must be above 0 (and at most 10)")
    if not 0 < args.upstream_scale <= 10:
        return _fail("--upstream-scale must be above 0 (and at most 10)")
    try:
        config = load_config(args.config)
    except ConfigError as e:
        return _fail(str(e))
    found: list[tuple[str, str, Recording]] = []
    for path in args.files:
        try:
            fmt, recordings = read_recordings(path, args.format)
        except FormatError as e:
            return _fail(str(e))
        found += [(path, fmt, r) for r in recordings]
    try:
        models = Models(config)
    except (GatewayError, ValueError) as e:  # a model_list litellm cannot route, a bad retry setting
        return _fail(f"{args.config}: {getattr(e, 'message', e)}")
    try:
        results = asyncio.run(_replay_all(_named(found), config, models, args))
    except SessionFailed as e:
        return _fail(str(e))
    out = Path(args.out)
    console = Console(width=None if sys.stdout.isatty() else 260)
    console.print(results_table(results))
    written = write_report(results, out)
    console.print(f"report: {written}")
    return 0


class SessionFailed(Exception):
    """A session the pipeline failed on: the command says which, in one line."""


@dataclass
class _Job:
    path: str
    format: str
    recording: Recording
    turns: int


async def _replay_all(found: list[tuple[str, str, Recording]], config: Config, models: Models,
                      args: argparse.Namespace) -> list[SessionResult]:
    profile = args.profile or config.ctxgate.profile
    pipeline_config = config.pipeline_config(profile)
    jobs = [_Job(path, fmt, r, len(agent_turns(r.messages))) for path, fmt, r in found]
    results: list[SessionResult] = []
    summarizers: dict[str, Summarizer] = {}
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=False)
    try:
        with progress:
            task = progress.add_task("replaying", total=sum(j.turns for j in jobs))
            for job in jobs:
                r = job.recording
                progress.update(task, description=f"replaying {r.name[:50]}")
                target = models.target(args.model or models.default_name(r.model))
                summarizer_model = pipeline_config.autocompact.model or target.name
                if summarizer_model not in summarizers:  # one per model: a failure is not paid for again
                    summarizers[summarizer_model] = Summarizer(
                        target.counter, models.summarizing_gateway(summarizer_model), summarizer_model,
                        pipeline_config.autocompact.timeout_s)
                summarizer = summarizers[summarizer_model]
                calls_before = len(summarizer.prompt_tokens)
                peak = _peak(r, target.counter)
                limit = args.budget or (max(1, int(args.ratio * peak)) if args.ratio else target.limit)
                try:
                    run: Replay = await replay(r.messages, r.tools, limit, counter=target.counter,
                                               summarize=summarizer, config=pipeline_config, wait_background=True,
                                               prices=target.prices, enforce_limit=args.enforce_limit,
                                               provider_count=_upstream_count(target.counter, r, args.upstream_scale),
                                               on_turn=lambda _: progress.advance(task))
                except Exception as e:  # content the readers let through but the pipeline cannot take
                    raise SessionFailed(f"{job.path}: session {r.name} could not be replayed: "
                                        f"{type(e).__name__}: {e}") from e
                setting = Setting(file=job.path, format=job.format, model=target.name, limit=limit,
                                  config=pipeline_config, peak=peak, summarizer=summarizer.described(),
                                  summary_calls=list(zip(summarizer.prompt_tokens[calls_before:],
                                                         summarizer.summary_tokens[calls_before:])),
                                  prices=target.prices)
                results.append(session_result(r, run, target.counter, setting))
    finally:
        for summarizer in summarizers.values():
            if summarizer.gateway is not None:
                await summarizer.gateway.close()
    return results


def _upstream_count(counter: TokenCounter, recording: Recording, scale: float) -> Callable[[list[Message]], int] | None:
    """The upstream's count of a forwarded request; None: ctxgate's own."""
    if scale == 1.0:
        return None
    count = ProviderCount(counter, recording.tools)
    return lambda messages: round(count(messages) * scale)


def _peak(recording: Recording, counter: TokenCounter) -> int:
    """The agent's largest request: its history up to its last reply, and the tools schema."""
    turns = agent_turns(recording.messages)
    last = turns[-1] if turns else len(recording.messages)
    return counter.count_messages(recording.messages[:last]) + counter.count_tools(recording.tools)
