"""Fixtures for the real-vLLM e2e suite: two vLLM CPU engines (tiny model) and
Switchyard gateways in front of them. Processes live in tests/e2e/engines.py: each
is waited on through its readiness endpoint with a deadline and stopped by PID
(process group) at teardown, also when the run is interrupted. Run through
tests/e2e/run.sh."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from engines import (  # noqa: E402
    LOG_DIR, SWITCHYARD, Engine, Gateway, gateway_config, install_sigterm_handler,
    start_engines, stop,
)
from engines import start_gateway as _start_gateway  # noqa: E402

install_sigterm_handler()


def pytest_configure(config):
    config.addinivalue_line("markers", "kills_engine: runs after every other test of the suite")


def pytest_collection_modifyitems(items):
    """Tests that kill an engine run last, whatever file they are in (stable sort:
    the others keep their file order)."""
    items.sort(key=lambda it: it.get_closest_marker("kills_engine") is not None)


@pytest.fixture(scope="session")
def engines():
    try:
        started = start_engines()
    except RuntimeError as e:
        pytest.fail(str(e))
    try:
        yield started
    finally:
        for e in started:
            stop(e.proc)


def supports_routing() -> tuple[bool, str]:
    """Whether this gateway binary has the stats poller and the `prefix` policy:
    `check-config` on a config that uses both."""
    cfg = gateway_config([SimpleNamespace(url="http://127.0.0.1:9")], "prefix", True)
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(cfg)
    try:
        r = subprocess.run([SWITCHYARD, "check-config", f.name], capture_output=True, text=True,
                           timeout=30)
    finally:
        os.unlink(f.name)
    return r.returncode == 0, (r.stdout + r.stderr).strip()


@pytest.fixture(scope="session")
def routing_supported() -> bool:
    ok, msg = supports_routing()
    if not ok:
        print(f"\n[e2e] {SWITCHYARD} rejects policy=prefix/[pools.routing]: {msg}", flush=True)
    return ok


@pytest.fixture(scope="session")
def start_gateway(engines):
    """Factory: a Switchyard gateway with the given policy in front of the engines, or
    with a whole TOML `config` of the test's own (`name` then names its log)."""
    if not os.access(SWITCHYARD, os.X_OK):
        pytest.fail(f"{SWITCHYARD} missing: cargo build first")
    started: list[Gateway] = []

    def start(policy: str = "", routing: bool = False, targets: list[Engine] | None = None,
              debug_headers: bool = False, config: str = "", name: str = "") -> Gateway:
        cfg = config or gateway_config(targets or engines, policy, routing, debug_headers)
        try:
            gw = _start_gateway(cfg, LOG_DIR / f"gateway-{len(started)}-{name or policy}.log")
        except RuntimeError as e:
            pytest.fail(str(e))
        started.append(gw)
        return gw

    yield start
    for gw in started:
        stop(gw.proc, grace=5)
