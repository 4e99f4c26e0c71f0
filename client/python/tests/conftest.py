"""conftest.py - pytest fixtures for the kvstash package's tests: a real
kvstashd (tests/integration/kvstash_harness.py's Daemon) and the paths of
the real worker binaries.

ctest (tests/CMakeLists.txt, python/pytest) sets KVSTASH_LIB, KVSTASHD,
KVSTASH_TEST_WORKER, KVSTASH_BUILD_DIR and PYTHONPATH; run by hand, the
defaults are those of the build tree <repo>/build:

    /usr/bin/python3 -m pytest -q client/python/tests
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
BUILD = os.environ.get("KVSTASH_BUILD_DIR") or os.path.join(REPO, "build")

# The package under test first (so that `kvstash` is this one and the wire
# stubs join it as kvstash.v1), then the harness and the stubs.
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path += [os.path.join(REPO, "tests", "integration"), os.path.join(BUILD, "tests", "py")]
for var, default in (("KVSTASHD", os.path.join(BUILD, "daemon", "kvstashd")),
                     ("KVSTASH_TEST_WORKER", os.path.join(BUILD, "tests", "kvs_test_worker")),
                     ("KVSTASH_LIB", os.path.join(BUILD, "client", "libkvstash.so")),
                     ("KVSTASH_BUILD_DIR", BUILD)):
    os.environ.setdefault(var, default)
# Child Python processes (peer.py, py_worker.py, fake_kvstashd.py) import the
# same package, the harness and the wire stubs.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [os.path.join(REPO, "client", "python"), os.path.join(BUILD, "tests", "py"),
     os.path.join(REPO, "tests", "integration")] +
    [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

from kvstash_harness import Daemon  # noqa: E402


def start_daemon(**kwargs) -> Daemon:
    """A fresh kvstashd, by default on the host backend: the tests read the
    pool through numpy."""
    kwargs.setdefault("backend", "host")
    d = Daemon(**kwargs)
    d.start()
    return d


def stop_daemon(d: Daemon) -> None:
    """Stop with the harness's check (exit 0 on SIGTERM, else the assertion
    carries the log's tail); a test that killed its daemon on purpose sets
    d.proc to None."""
    try:
        if d.proc is not None:
            d.stop()
    finally:
        d.kill()
        d.cleanup()


@pytest.fixture(scope="module")
def daemon():
    """One daemon for a test module (tests use distinct model names)."""
    d = start_daemon()
    yield d
    stop_daemon(d)


@pytest.fixture
def fresh_daemon():
    """A daemon of the test's own: for tests that count sessions or blocks."""
    d = start_daemon()
    yield d
    stop_daemon(d)


@pytest.fixture
def make_daemon():
    """start(**Daemon kwargs) -> Daemon, each stopped at the end (e.g. a tiny --pool-mb)."""
    started = []

    def make(**kwargs) -> Daemon:
        d = start_daemon(**kwargs)
        started.append(d)
        return d

    yield make
    for d in started:
        stop_daemon(d)

