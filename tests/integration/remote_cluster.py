"""remote_cluster.py - what the remote tier's integration tests share
(test_remote, test_remote_spill): a Redis Cluster of their own on loopback
ports (tests/remote/cluster.py), a key namespace of their own, kvstashd's
flags for both, the keys of one sequence uid, and a master killed while a
call is in flight there.
"""
import os
import sys
import tempfile
import threading
import time

from kvstash_harness import run_tests

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "remote"))
import cluster  # noqa: E402  tests/remote/cluster.py


def assert_remote_down(err):
    """err is the remote tier's answer for a node that died or hung under a
    call: UNAVAILABLE or DEADLINE_EXCEEDED."""
    assert "remote tier: " in err and ("UNAVAILABLE" in err or "DEADLINE_EXCEEDED" in err), err


class RemoteCluster:
    def __init__(self, ns_prefix):
        self.dir = tempfile.mkdtemp(prefix="kvstash-redis.")
        self.ns = f"{ns_prefix}{os.getpid()}"
        self.ports = []

    def args(self, extra=()):
        """kvstashd's flags for this cluster: two seeds, the namespace, a
        200-ms probe and a 500-ms node timeout (the tests wait on both)."""
        seeds = ",".join(f"127.0.0.1:{p}" for p in self.ports[:2])
        return ["--remote", seeds, "--remote-namespace", self.ns, "--remote-probe-ms", "200",
                "--remote-timeout-ms", "500", *extra]

    def keys_of(self, uid):
        """Every key of sequence uid (an export's, or a spill's), sorted."""
        return cluster.keys(self.dir, f"kvs:{self.ns}:{{default:{uid}}}:*")

    def owner_port(self, key):
        return cluster.owner(self.dir, cluster.key_slot(key))

    def kill_in_flight(self, dead, start, pause=0.2):
        """Hang the master at port `dead` (DEBUG SLEEP, 3 s), call start()
        (which begins a call that reaches it and returns a function waiting
        for the call's result), kill that master `pause` s later, and return
        the call's result: the call was in flight on the dying node."""
        sleeper = cluster.hang(dead, 3)
        time.sleep(0.2)
        finish = start()
        time.sleep(pause)
        cluster.kill(self.dir, dead)
        try:
            return finish()
        finally:
            sleeper.join()

    def cli_in_flight(self, dead, run, *args, pause=0.2):
        """kvstash ARGS (`run`: test_cli's) on a thread, as kill_in_flight's
        call: it must fail, status 1, with the remote tier's code."""
        def start():
            box = {}
            t = threading.Thread(target=lambda: box.update(r=run(*args)))
            t.start()
            return lambda: (t.join(), box["r"])[1]
        rc, _, err = self.kill_in_flight(dead, start, pause)
        assert rc == 1, (rc, err)
        assert_remote_down(err)

    def run(self, name, checks, daemon_extra=()):
        """Start 3 masters with a replica each, run the checks against a
        daemon on this cluster (16-MiB pool, daemon_extra flags), stop the
        cluster. A cluster that cannot start fails the test."""
        try:
            self.ports = cluster.start(self.dir, masters_n=3, replicas_n=1,
                                       owner_pid=os.getpid())
        except Exception as e:  # noqa: BLE001 - reported as the test's failure
            print(f"FAIL cluster start: {e} (ops/setup.sh installs redis-server)")
            print(f"{name}: 0 passed, 1 failed")
            return 1
        try:
            return run_tests(name, checks, daemon_kwargs={"pool_mb": 16,
                                                         "extra_args": self.args(daemon_extra)})
        finally:
            cluster.stop(self.dir)
