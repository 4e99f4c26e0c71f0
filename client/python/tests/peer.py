"""peer.py - another worker process that looks at the pool through its own
session (its own mapping), for the zero-copy tests.

argv: SOCKET MODEL GEOMETRY_JSON. It attaches (same model and geometry:
same pool), answers {"ok": true, "session": id, "pool": id}, then serves
one JSON request per stdin line until EOF:
  {"op": "keys", "block": b}           -> {"ok": true, "keys": [...], "values": [...]}
      the K and V halves of block b as nested lists, read through its views
  {"op": "fill", "block": b, "head": h, "slot": s, "value": x}
      -> {"ok": true}: K row (h, s) of block b set to x through a torch
         tensor over its numpy view (torch.from_numpy): no libkvstash call
"""
import json
import sys

import kvstash


def main() -> int:
    sock, model, geo_json = sys.argv[1:4]
    geo = kvstash.Geometry(**json.loads(geo_json))
    with kvstash.Session.attach(model, geo, socket=sock, worker_name="peer") as s:
        print(json.dumps({"ok": True, "session": s.id, "pool": s.pool_id}), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            if req["op"] == "keys":
                b = req["block"]
                reply = {"ok": True, "keys": s.block_keys(b).tolist(),
                         "values": s.block_values(b).tolist()}
            elif req["op"] == "fill":
                import torch  # only this request needs it
                keys = torch.from_numpy(s.block_keys(req["block"]))
                keys[req["head"], req["slot"], :] = req["value"]
                reply = {"ok": True}
            else:
                reply = {"ok": False, "error": f"unknown op {req['op']!r}"}
            print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
