"""``python -m gpucache [ADDRESS] [--tenant T] [--key-file F] [--key-id K]``: prints this
package's version, whether the server at ADDRESS (default 127.0.0.1:7470, the native GPCW
listener) is reachable, and what it offers (limits, the same-host path). Exits 0 when it is
reachable, 1 when it is not."""

from __future__ import annotations

import argparse
import json
import sys

import gpucache


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpucache", description=__doc__.split("\n\n")[0])
    p.add_argument("address", nargs="?", default="127.0.0.1:7470",
                   help="the native (GPCW) listener of gpucache serve")
    p.add_argument("--tenant", default="default")
    p.add_argument("--key-file", default=None)
    p.add_argument("--key-id", default=None)
    p.add_argument("--timeout-s", type=float, default=5.0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    out: dict = {"version": gpucache.__version__, "address": a.address}
    try:
        with gpucache.Client(a.address, tenant=a.tenant, key_file=a.key_file, key_id=a.key_id,
                             local="auto", timeout_s=a.timeout_s) as c:
            offers = c.offers()
        out["reachable"] = True
        out["offers"] = offers
    except gpucache.Error as e:
        out["reachable"] = False
        out["error"] = f"{type(e).__name__}: {e}"
    if a.json:
        print(json.dumps(out, sort_keys=True))
    else:
        print(f"gpucache {out['version']}")
        if out["reachable"]:
            o = out["offers"]
            print(f"server {a.address}: reachable (tenant {o['tenant']})")
            print(f"  transport used: {o['transport']}")
            if o["same_host_offered"] is None:
                print("  same-host path: unknown")
            elif o["same_host_offered"]:
                print(f"  same-host path: offered at {o['local_socket']}")
            else:
                print("  same-host path: not offered")
            if o.get("fallback"):
                print(f"  (fell back to TCP: {o['fallback']})")
            obj = o["object_bytes_max"]
            print(f"  object_bytes_max: {obj if obj is not None else 'not stated'}")
            print(f"  payload_bytes_max: {o['payload_bytes_max']}")
            print(f"  batch_items_max: {o['batch_items_max']}")
            s = o["server"]
            print(f"  store: {s['implementation']}, when full: {s['full_policy']}")
        else:
            print(f"server {a.address}: not reachable: {out['error']}")
    return 0 if out["reachable"] else 1


if __name__ == "__main__":
    sys.exit(main())
