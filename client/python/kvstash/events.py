"""events.py - the daemon's event feed as an iterator (kvs_events_*).

Each event is "<topic> <json>" on a nanomsg SUB socket (docs/protocol.md,
"Events"); every object carries "n", the feed's counter, so a gap shows
that events were dropped. nanomsg subscribes in the background: events
published before the subscription is live are not seen (subscribe, then
wait for a first event you cause, as the tests do).
"""
import ctypes
import json
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Optional

from . import _lib
from .errors import KVS_ERR_UNAVAILABLE, error_for
from .session import default_socket


@dataclass
class Event:
    """One event: its topic ("seq.created", "worker.reclaimed", ...), its
    parsed JSON object, and the text as received."""
    topic: str
    data: Dict[str, Any] = field(default_factory=dict)
    raw: str = ""


def parse(text: str) -> Event:
    """"topic {json}" -> Event (data {} when the JSON part is missing)."""
    topic, _, body = text.partition(" ")
    return Event(topic, json.loads(body) if body.strip() else {}, text)


class Events:
    """A subscription to the feed. Iterating yields Events until none comes
    within timeout_ms (negative: wait forever); next_event(timeout_ms) waits
    for one. A context manager whose exit closes the socket."""

    def __init__(self, socket: Optional[str] = None, timeout_ms: int = 1000):
        self._lib = _lib.lib()
        self.socket = socket or default_socket()
        self.timeout_ms = timeout_ms
        sock = self._lib.kvs_events_open(self.socket.encode())
        if sock < 0:
            raise error_for(sock, f"events: cannot subscribe to {self.socket}.events")
        self._sock: Optional[int] = sock

    def next_event(self, timeout_ms: Optional[int] = None) -> Optional[Event]:
        """The next event, or None when none came in time (or a signal
        interrupted the wait)."""
        if self._sock is None:
            raise error_for(-1, "events: the subscription is closed")
        buf = ctypes.c_void_p()
        wait = self.timeout_ms if timeout_ms is None else timeout_ms
        rc = self._lib.kvs_events_next(self._sock, wait, ctypes.byref(buf))
        if rc == KVS_ERR_UNAVAILABLE:
            return None
        if rc:
            raise error_for(rc, f"events: receiving from {self.socket}.events failed")
        try:
            text = ctypes.string_at(buf.value).decode("utf-8", "replace")
        finally:
            _lib.libc_free(buf)
        return parse(text)

    def __iter__(self) -> Iterator[Event]:
        while True:
            ev = self.next_event()
            if ev is None:
                return
            yield ev

    def close(self) -> None:
        if self._sock is not None:
            self._lib.kvs_events_close(self._sock)
            self._sock = None

    def __enter__(self) -> "Events":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def events(socket: Optional[str] = None, timeout_ms: int = 1000) -> Events:
    """Subscribe to the daemon's events: `for ev in kvstash.events(): ...`"""
    return Events(socket, timeout_ms)
