"""TLS with client certificates on kvstashd's TCP port (issue 12, problem 3).

A self-signed CA made here with the `openssl` CLI signs a server certificate
(SAN 127.0.0.1 and localhost) and a client certificate; a second CA signs an
impostor's. kvstashd serves --listen 127.0.0.1:PORT with tls-cert, tls-key
and tls-client-ca. Checks: a client with a certificate of the CA gets Health
and, without a session token, nothing more (UNAUTHENTICATED); a client
without a certificate, with one of another CA, or without TLS fails the
handshake (UNAVAILABLE); the `kvstash` CLI reaches the port with
$KVSTASH_TLS_* or --tls-* and not without; kvstashd refuses to start (exit 2,
a message naming the keys) with a partial TLS configuration, an unreadable
file, or a non-loopback --listen without TLS.
"""
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import grpc

from kvstash_harness import (RPC_TIMEOUT, SERVING, health_pb2, pb, pb_grpc, run_tests)

CLI = os.environ.get("KVSTASH_CLI", "")
if not CLI and os.environ.get("KVSTASH_BUILD_DIR"):
    CLI = os.path.join(os.environ["KVSTASH_BUILD_DIR"], "client", "kvstash")
CERTS = tempfile.mkdtemp(prefix="kvstash-tls.")


def openssl(*args):
    p = subprocess.run(["openssl", *args], cwd=CERTS, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, f"openssl {' '.join(args)}: {p.stderr}"


def make_ca(name):
    # EC keys: a fraction of RSA's generation time.
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
            "-subj", f"/CN=kvstash test {name}")


def make_cert(name, ca, ext):
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=kvstash {name}")
    with open(os.path.join(CERTS, f"{name}.ext"), "w") as f:
        f.write(ext + "\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")


def path(name):
    return os.path.join(CERTS, name)


def read(name):
    with open(path(name), "rb") as f:
        return f.read()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


make_ca("ca")
make_ca("other-ca")
make_cert("server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
          "extendedKeyUsage=serverAuth")
make_cert("client", "ca", "extendedKeyUsage=clientAuth")
make_cert("impostor", "other-ca", "extendedKeyUsage=clientAuth")
PORT = free_port()
ADDR = f"127.0.0.1:{PORT}"
TLS_ARGS = ["--tls-cert", path("server.pem"), "--tls-key", path("server.key"),
            "--tls-client-ca", path("ca.pem")]


def health_call(channel):
    return channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString)


def tls_channel(key=None, cert=None):
    creds = grpc.ssl_channel_credentials(
        root_certificates=read("ca.pem"), private_key=read(key) if key else None,
        certificate_chain=read(cert) if cert else None)
    return grpc.secure_channel(ADDR, creds)


def expect_unavailable(channel, who):
    try:
        health_call(channel)(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE, \
            f"{who}: {e.code().name} ({e.details()}), expected UNAVAILABLE"
        return
    finally:
        channel.close()
    raise AssertionError(f"{who}: Health answered; the handshake should have failed")


def check_client_with_a_certificate_gets_health_and_no_more(ctx):
    ch = tls_channel("client.key", "client.pem")
    try:
        r = health_call(ch)(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT)
        assert r.status == SERVING, f"Health over TLS: {r.status}"
        # TLS says who may connect; a session token still says who may act.
        try:
            pb_grpc.StoreStub(ch).Stats(pb.StatsRequest(), timeout=RPC_TIMEOUT)
            raise AssertionError("Stats over TLS without a token answered")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED, \
                f"Stats without a token: {e.code().name} ({e.details()})"
    finally:
        ch.close()


def check_client_without_a_certificate_fails_the_handshake(ctx):
    expect_unavailable(tls_channel(), "TLS client without a certificate")


def check_certificate_of_another_ca_fails_the_handshake(ctx):
    expect_unavailable(tls_channel("impostor.key", "impostor.pem"),
                       "client with a certificate of another CA")


def check_plain_text_client_fails(ctx):
    expect_unavailable(grpc.insecure_channel(ADDR), "plain-text client")


def cli(*args, env_tls=False):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTASH_TLS_")}
    if env_tls:
        env.update(KVSTASH_TLS_CA=path("ca.pem"), KVSTASH_TLS_CERT=path("client.pem"),
                   KVSTASH_TLS_KEY=path("client.key"))
    env["KVSTASH_RPC_TIMEOUT_MS"] = "3000"
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=30, env=env)


def check_cli_reaches_the_port_with_its_certificate_only(ctx):
    assert CLI and os.access(CLI, os.X_OK), f"no kvstash CLI at {CLI!r}"
    p = cli("health", "--addr", ADDR, env_tls=True)
    assert p.returncode == 0 and "SERVING" in p.stdout, \
        f"kvstash health --addr with $KVSTASH_TLS_*: exit {p.returncode} {p.stdout!r} {p.stderr!r}"
    p = cli("--addr", ADDR, "--tls-ca", path("ca.pem"), "--tls-cert", path("client.pem"),
            "--tls-key", path("client.key"), "health")
    assert p.returncode == 0 and "SERVING" in p.stdout, \
        f"kvstash --addr --tls-* health: exit {p.returncode} {p.stdout!r} {p.stderr!r}"
    p = cli("health", "--addr", ADDR)
    assert p.returncode == 3 and p.stderr.startswith("kvstash: "), \
        f"kvstash health --addr without TLS: exit {p.returncode} {p.stderr!r}, expected 3"
    p = cli("health", "--addr", ADDR, "--tls-ca", path("ca.pem"))
    assert p.returncode != 0 and "KVSTASH_TLS_CERT" in p.stderr, \
        f"kvstash with only a CA: exit {p.returncode} {p.stderr!r}"
    p = cli("status", "--addr", ADDR, env_tls=True)
    assert p.returncode != 0 and "kvstash-token" in p.stderr, \
        f"kvstash status over TLS without a token: exit {p.returncode} {p.stderr!r}"


def refused(ctx, args, needle):
    d = ctx.daemon
    sock = os.path.join(d.dir, "refused.sock")
    p = subprocess.run([d.binary, "--socket", sock, "--backend", d.backend, *args],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2, f"kvstashd {' '.join(args)}: exit {p.returncode}, expected 2 " \
                              f"({p.stderr!r})"
    assert needle in p.stderr, f"kvstashd {' '.join(args)}: {p.stderr!r} lacks {needle!r}"


def check_daemon_refuses_bad_tls_configurations(ctx):
    port = str(free_port())
    refused(ctx, ["--listen", "127.0.0.1:" + port, "--tls-cert", path("server.pem")],
            "tls-cert, tls-key and tls-client-ca go together")
    refused(ctx, ["--listen", "127.0.0.1:" + port, "--tls-cert", path("server.pem"),
                  "--tls-key", path("server.key"), "--tls-client-ca", path("missing.pem")],
            "tls-client-ca " + path("missing.pem"))
    refused(ctx, ["--listen", "127.0.0.1:" + port, "--tls-cert", path("server.ext"),
                  "--tls-key", path("server.key"), "--tls-client-ca", path("ca.pem")],
            "no PEM block")
    refused(ctx, ["--listen", "192.0.2.1:" + port], "set tls-cert, tls-key and tls-client-ca")
    refused(ctx, [*TLS_ARGS], "--listen, which is off")


def start_fails(ctx, args, needle):
    d = ctx.daemon
    sock = os.path.join(d.dir, "fails.sock")
    p = subprocess.run([d.binary, "--socket", sock, "--backend", d.backend, *args],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and needle in p.stderr, \
        f"kvstashd {' '.join(args)}: exit {p.returncode}, expected 1 and {needle!r} " \
        f"(gRPC aborted at -6 when a server with its Unix port open was destroyed):\n" \
        f"{p.stderr[-600:]}"
    assert not os.path.exists(sock), f"{sock} left behind"


def check_daemon_fails_cleanly_when_the_tcp_port_cannot_open(ctx):
    # A certificate and a key that are not a pair: gRPC refuses the port.
    openssl("genpkey", "-algorithm", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-out", "stray.key")
    start_fails(ctx, ["--listen", f"127.0.0.1:{free_port()}", "--tls-cert", path("server.pem"),
                      "--tls-key", path("stray.key"), "--tls-client-ca", path("ca.pem")],
                "with TLS (are tls-cert and tls-key a pair?)")
    # The port is taken by the daemon under test: gRPC's default SO_REUSEPORT
    # let a second kvstashd share it (and take half the clients) unseen.
    start_fails(ctx, ["--listen", ADDR, *TLS_ARGS], f"cannot listen on {ADDR}")


def main():
    try:
        return run_tests("test_tls", [
            check_client_with_a_certificate_gets_health_and_no_more,
            check_client_without_a_certificate_fails_the_handshake,
            check_certificate_of_another_ca_fails_the_handshake,
            check_plain_text_client_fails,
            check_cli_reaches_the_port_with_its_certificate_only,
            check_daemon_refuses_bad_tls_configurations,
            check_daemon_fails_cleanly_when_the_tcp_port_cannot_open,
        ], daemon_kwargs={"extra_args": ["--listen", ADDR, *TLS_ARGS]}, time_limit=90)
    finally:
        shutil.rmtree(CERTS, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
