import os
import sys
from typing import Iterator

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from servers import LIVE, Gateway, RedisServer, main_config, start_gateways, stop_all  # noqa: E402
from upstream import ScriptedUpstream  # noqa: E402

FORWARDING = ("auto", "litellm")
pytest_plugins = ["browser"]


@pytest.fixture(scope="session")
def upstream() -> Iterator[ScriptedUpstream]:
    """The scripted OpenAI-compatible upstream, in a thread of the test process."""
    up = ScriptedUpstream().start()
    yield up
    up.stop()


@pytest.fixture
def up(upstream: ScriptedUpstream) -> ScriptedUpstream:
    """The upstream with an empty log and its default behaviour, for one test."""
    upstream.reset()
    upstream.limit, upstream.slow_s, upstream.framing_tokens = 0, 3.0, 0
    return upstream


@pytest.fixture(scope="session")
def main_gateways(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Gateway]]:
    """`ctxgate serve` once per forwarding mode, started together, over the same upstream."""
    base = tmp_path_factory.mktemp("gateways")
    gateways = start_gateways({f: (base / f, main_config(upstream.url, f)) for f in FORWARDING})
    yield gateways
    stop_all(gateways.values())


@pytest.fixture(scope="session", params=FORWARDING)
def gateway(request: pytest.FixtureRequest, main_gateways: dict[str, Gateway]) -> Gateway:
    """The same tests on both paths: ctxgate's own aiohttp client, and litellm."""
    return main_gateways[request.param]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer.start(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


def _gateways_of(item: pytest.Item) -> list[Gateway]:
    found: list[Gateway] = []
    for value in getattr(item, "funcargs", {}).values():
        values = value.values() if isinstance(value, dict) else [value]
        found += [v for v in values if isinstance(v, Gateway)]
    return found or list(LIVE)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failing test shows what its ctxgate processes printed."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed:
        for gw in _gateways_of(item):
            report.sections.append((f"ctxgate {gw.name} output (tail)", gw.text()[-3000:]))
