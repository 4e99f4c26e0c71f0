"""The event feed as an iterator (issue 13, acceptance 1): the daemon's
events, parsed, in order."""
import pytest

import kvstash
from kvstash import Geometry, Session

GEO = Geometry(layers=2, q_heads=4, kv_heads=2, head_dim=8, block_tokens=4)


def subscribed(feed, sock, tries=40):
    """nanomsg subscribes in the background: create probe sequences until
    one's seq.created arrives, so that nothing after it is missed."""
    with Session.attach("events-probe", GEO, socket=sock) as s:
        for _ in range(tries):
            with s.create_sequence(label="probe") as probe:
                pass
            ev = feed.next_event(100)
            while ev is not None:
                if ev.topic == "seq.created" and ev.data["seq"] == probe.id:
                    return
                ev = feed.next_event(100)
    raise AssertionError(f"no probe's seq.created arrived in {tries} tries")


def test_iterator_yields_the_daemons_events(fresh_daemon):
    sock = fresh_daemon.sock
    with kvstash.events(socket=sock, timeout_ms=500) as feed:
        subscribed(feed, sock)
        with Session.attach("events", GEO, socket=sock, worker_name="watched") as s:
            with s.create_sequence("streaming", {"n_sink": 0, "window": 4}, label="ev") as seq:
                seq.append(6)
                seq.step(new_tokens=6)  # streaming keeps 4: a table change
        events = [ev for ev in feed]  # ends when 500 ms pass without one
    mine = [e for e in events if e.data.get("session") == s.id or e.data.get("seq") == seq.id]
    topics = [e.topic for e in mine]
    assert topics[:2] == ["worker.attached", "seq.created"], topics
    assert "table.changed" in topics and "seq.released" in topics, topics
    assert topics[-1] == "worker.reclaimed", topics
    attached, created = mine[0], mine[1]
    assert attached.data["name"] == "watched" and attached.data["session"] == s.id
    assert created.data["policy"] == "streaming" and created.data["seq"] == seq.id
    changed = next(e for e in mine if e.topic == "table.changed")
    assert changed.data["seq"] == seq.id and changed.data["evicted"] == 2 * GEO.layers
    assert mine[-1].data["reason"] == "detach"
    ns = [e.data["n"] for e in events]
    assert ns == list(range(ns[0], ns[0] + len(ns))), "events were dropped or reordered"
    assert all(e.raw.startswith(e.topic + " {") for e in events)


def test_timeouts_and_close(fresh_daemon):
    feed = kvstash.Events(socket=fresh_daemon.sock, timeout_ms=50)
    assert feed.next_event() is None and list(feed) == []
    feed.close()
    feed.close()
    with pytest.raises(kvstash.InvalidArgument, match="closed"):
        feed.next_event()


def test_parse():
    from kvstash.events import parse  # kvstash.events is the function; this, its module
    ev = parse('seq.created {"n": 3, "seq": 7}')
    assert (ev.topic, ev.data) == ("seq.created", {"n": 3, "seq": 7})
