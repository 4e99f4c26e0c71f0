"""fake_kvstashd.py - a stand-in daemon that misbehaves on purpose, for the
error paths a real kvstashd never takes (or takes only with a remote tier
that lost a value): libkvstash's KVS_ERR_PROTOCOL, KVS_ERR_SYSTEM and
KVS_ERR_DATA_LOSS.

argv: SOCKET MODE. It serves the fd socket (SOCKET.fd: HELLO, MAP, as
docs/protocol.md says) and the gRPC Store's Attach on SOCKET (Python's
grpcio), prints READY, and runs until killed. MODE:
  aborted        Attach fails with gRPC ABORTED, a status libkvstash maps
                 to no other kvs_err (PROTOCOL), with a message of its own
  data-loss      Attach fails with gRPC DATA_LOSS (DATA_LOSS)
  readonly-pool  Attach succeeds; MAP hands over a read-only file, so the
                 worker's mmap(PROT_WRITE, MAP_SHARED) fails (SYSTEM)
"""
import os
import socket
import sys
import tempfile
import threading
from concurrent import futures

import grpc

from kvstash.v1 import store_pb2 as pb
from kvstash.v1 import store_pb2_grpc as pb_grpc

DATA_LOSS_MESSAGE = "fake kvstashd: the pool went missing (DATA_LOSS on purpose)"
ABORTED_MESSAGE = "fake kvstashd: gave up (ABORTED on purpose)"
POOL_BLOCKS = 4


class Store(pb_grpc.StoreServicer):
    def __init__(self, mode: str):
        self.mode = mode
        self.pool_bytes = 0

    def Attach(self, request, context):
        if self.mode == "data-loss":
            context.abort(grpc.StatusCode.DATA_LOSS, DATA_LOSS_MESSAGE)
        if self.mode == "aborted":
            context.abort(grpc.StatusCode.ABORTED, ABORTED_MESSAGE)
        g = request.geometry
        elt = 4 if g.dtype == pb.DTYPE_FP32 else 2
        block_bytes = 2 * g.kv_heads * g.block_tokens * g.head_dim * elt
        self.pool_bytes = POOL_BLOCKS * block_bytes
        return pb.AttachResponse(session_id=1, pool_id=1, backend="host",
                                 pool_bytes=self.pool_bytes, block_bytes=block_bytes,
                                 block_count=POOL_BLOCKS, geometry=g)


def readonly_file(nbytes: int) -> int:
    """An fd, opened read-only, of a file of nbytes (unlinked)."""
    fd, path = tempfile.mkstemp(prefix="fake-kvstashd-pool.")
    os.ftruncate(fd, nbytes)
    os.close(fd)
    ro = os.open(path, os.O_RDONLY)
    os.unlink(path)
    return ro


def serve_fd_socket(path: str, store: Store) -> None:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(8)

    def client(conn: socket.socket) -> None:
        with conn:
            while True:
                msg = conn.recv(1024).decode("ascii", "replace")
                if not msg:
                    return
                if msg == "HELLO 1":
                    conn.send(b"OK " + b"0123456789abcdef" * 2)
                elif msg.startswith("MAP "):
                    fd = readonly_file(store.pool_bytes)
                    socket.send_fds(conn, [f"OK {store.pool_bytes}".encode()], [fd])
                    os.close(fd)
                else:
                    conn.send(b"ERR fake kvstashd knows only HELLO and MAP")

    def accept() -> None:
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=client, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


def main() -> int:
    sock, mode = sys.argv[1:3]
    store = Store(mode)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_StoreServicer_to_server(store, server)
    server.add_insecure_port("unix:" + sock)
    server.start()
    serve_fd_socket(sock + ".fd", store)
    print("READY", flush=True)
    server.wait_for_termination()
    return 0


if __name__ == "__main__":
    sys.exit(main())
