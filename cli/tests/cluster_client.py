"""One Python client of the cluster test (cli/tests/cluster.rs): the same loop as the Rust
clients, through gpucache.Client.cluster. Each slot's key is written in numbered versions
(again only after a miss); every hit is compared with the versions written. Prints one JSON
line of counts when its time is up.

Usage: python cluster_client.py ETCD_URLS NAME TENANT CLIENT_ID SECONDS
"""

import hashlib
import json
import random
import sys
import time

import gpucache

SLOTS = 64
BLOCK = 4096


def version_bytes(client, slot, version):
    seed = hashlib.blake2b(f"{client}/{slot}/{version}".encode(), digest_size=64).digest()
    return seed * (BLOCK // len(seed))


def main():
    etcd, name, tenant, client_id, seconds = sys.argv[1:6]
    client_id, seconds = int(client_id), float(seconds)
    c = gpucache.Client.cluster(etcd.split(","), name=name, tenant=tenant, poll_ms=100, hot_reads=4)
    assert c.transport == "cluster", c.transport
    keys = [c.key(f"py{client_id}-slot{s}") for s in range(SLOTS)]
    acked = [None] * SLOTS
    written = [0] * SLOTS
    counts = dict(gets=0, hits=0, puts=0, put_errors=0, wrong=0, stale=0)
    rng = random.Random(client_id)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        slot = rng.randrange(SLOTS)
        if acked[slot] is not None:
            counts["gets"] += 1
            got = c.get(keys[slot])
            if got is not None:
                counts["hits"] += 1
                version = next(
                    (v for v in range(1, written[slot] + 1) if got == version_bytes(client_id, slot, v)),
                    None,
                )
                if version is None:
                    counts["wrong"] += 1
                elif version < acked[slot]:
                    counts["stale"] += 1
                continue
        written[slot] += 1
        v = written[slot]
        counts["puts"] += 1
        try:
            if c.put(keys[slot], version_bytes(client_id, slot, v)):
                acked[slot] = v
        except gpucache.Error:
            counts["put_errors"] += 1
    counts["offers"] = {k: v for k, v in c.offers().items() if k in ("epoch", "views", "refused", "copies", "copy_hits")}
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main()
