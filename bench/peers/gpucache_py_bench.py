#!/usr/bin/env python3
"""gpucache Python driver for `gpucache-bench python`.

One measurement of the `gpucache` package against a running `gpucache serve`: one client
(`gpucache.Client`, TCP or the same-host path), a source pool of `--working-set` bytes cut into
batches of `--items` values of `--size` bytes (each value stamped with its index in its first
8 bytes), and one destination of a batch's size. The PUT phase stores the pool batch by batch
with `batch_put_from` under fresh names `<prefix>-k<i>` until the pool is stored or the deadline
passes; the GET phase reads the stored batches back, in a cycle, with `batch_get_into` until the
deadline. Buffers are passed as int addresses with sizes, as an engine passes its KV pool's
pages. With `--buffers segment` the pool and the destination are `SharedBuffer`s inside the
segment shared with the server (docs/adr/0021), else plain host memory (a bytearray).

Untimed: filling the pool, and after the phases a check that every answer was a success, then
one batch read into a zeroed destination and compared byte for byte with what was put.

Prints one JSON object on stdout:
  {"put": {"ops", "bytes", "seconds", "p50_us", "p99_us", "errors"}, "get": {...},
   "verified": n, "mismatches": n, "transport": "tcp|local", "direct_items": n,
   "bounced_items": n, "layer_us": x, "error": null | "text"}
where layer_us is the binding's argument handling per call of this batch shape (see
layer_cost), untimed in the phases.
"""

import argparse
import ctypes
import json
import sys
import time


def percentile(sorted_us, p):
    if not sorted_us:
        return None
    rank = max(0, min(len(sorted_us) - 1, int(round(p / 100.0 * len(sorted_us) + 0.5)) - 1))
    return sorted_us[rank]


def phase(lat_us, ok_items, size, seconds, errors):
    lat = sorted(lat_us)
    return {
        "ops": len(lat),
        "bytes": ok_items * size,
        "seconds": seconds,
        "p50_us": percentile(lat, 50),
        "p99_us": percentile(lat, 99),
        "errors": errors,
    }


def pattern(size):
    base = bytes((i * 131 + 7) & 0xFF for i in range(256))
    return (base * (size // 256 + 1))[:size]


def layer_cost(c, keys, ptrs, sizes):
    """Microseconds per call of the binding's own work before any I/O: a batch_put_from whose
    sizes list is one short is refused (ValueError) after its list of keys has been converted,
    so it times the argument handling of a batch of this shape. Best of 5 runs of 200 calls."""
    short = sizes[:-1]
    best = None
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(200):
            try:
                c.batch_put_from(keys, ptrs, short)
            except ValueError:
                pass
        us = (time.perf_counter() - t) / 200 * 1e6
        best = us if best is None else min(best, us)
    return best


def measure(args):
    import gpucache

    n, size = args.items, args.size
    batch_bytes = n * size
    batches = max(1, args.working_set // batch_bytes)
    pool_bytes = batches * batch_bytes
    local = args.transport == "local"
    segment = pool_bytes + batch_bytes + (8 << 20) if args.buffers == "segment" else 64 << 20
    c = gpucache.Client(args.addr, tenant=args.tenant, local=local, timeout_s=60.0,
                        segment_bytes=max(segment, 1 << 20), client_name="gpucache-py-bench")
    keep = []  # what owns the buffers while the client uses them
    if args.buffers == "segment":
        pool_buf = c.shared_buffer(pool_bytes)
        dst_buf = c.shared_buffer(batch_bytes)
        if pool_buf is None or dst_buf is None:
            raise RuntimeError("the segment has no room for the pool")
        keep += [pool_buf, dst_buf]
        pool = gpucache.shared_view(pool_buf)
        dst = gpucache.shared_view(dst_buf)
        pool_ptr, dst_ptr = pool_buf.ptr, dst_buf.ptr
    else:
        pool = bytearray(pool_bytes)
        dst = bytearray(batch_bytes)
        pool_ptr = ctypes.addressof(ctypes.c_char.from_buffer(pool))
        dst_ptr = ctypes.addressof(ctypes.c_char.from_buffer(dst))
        pool, dst = memoryview(pool), memoryview(dst)
    base = pattern(size)
    for i in range(batches * n):
        at = i * size
        pool[at:at + size] = base
        pool[at:at + 8] = i.to_bytes(8, "little")
    dst[:] = b"\x01" * batch_bytes  # fault the destination in

    keys = [c.key(f"{args.prefix}-k{i}") for i in range(batches * n)]
    key_batches = [keys[j * n:(j + 1) * n] for j in range(batches)]
    src_ptrs = [[pool_ptr + (j * n + i) * size for i in range(n)] for j in range(batches)]
    dst_ptrs = [dst_ptr + i * size for i in range(n)]
    sizes = [size] * n

    out = {"verified": 0, "mismatches": 0, "transport": c.transport, "error": None}

    # PUT: each batch of the pool once, until the deadline.
    lat, errors, stored = [], 0, 0
    t0 = time.perf_counter()
    deadline = t0 + args.seconds
    for j in range(batches):
        if time.perf_counter() >= deadline:
            break
        a = time.perf_counter()
        answers = c.batch_put_from(key_batches[j], src_ptrs[j], sizes)
        lat.append((time.perf_counter() - a) * 1e6)
        if all(answers):
            stored += 1
        else:
            errors += 1
            break
    t1 = time.perf_counter()
    out["put"] = phase(lat, stored * n, size, t1 - t0, errors)

    # GET: the stored batches in a cycle, until the deadline.
    lat, errors, ok, j = [], 0, 0, 0
    t0 = time.perf_counter()
    deadline = t0 + args.seconds
    while stored and time.perf_counter() < deadline:
        a = time.perf_counter()
        got = c.batch_get_into(key_batches[j % stored], dst_ptrs, sizes)
        lat.append((time.perf_counter() - a) * 1e6)
        if got.count(size) == n:
            ok += n
        else:
            errors += 1
            break
        j += 1
    t1 = time.perf_counter()
    out["get"] = phase(lat, ok, size, t1 - t0, errors)

    # Verify: the last batch read, again into a zeroed destination, byte for byte.
    if stored:
        last = (j - 1) % stored if j else 0
        dst[:] = bytes(batch_bytes)
        got = c.batch_get_into(key_batches[last], dst_ptrs, sizes)
        at = last * batch_bytes
        if got.count(size) == n and bytes(dst) == bytes(pool[at:at + batch_bytes]):
            out["verified"] += n
        else:
            out["mismatches"] += n
    out["layer_us"] = layer_cost(c, key_batches[0], src_ptrs[0], sizes)
    shared = c.offers()["shared"]
    out["direct_items"] = shared["direct_items"]
    out["bounced_items"] = shared["bounced_items"]
    del pool, dst
    keep.clear()
    c.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--addr", required=True)
    ap.add_argument("--tenant", required=True)
    ap.add_argument("--transport", choices=["tcp", "local"], required=True)
    ap.add_argument("--buffers", choices=["host", "segment"], default="host")
    ap.add_argument("--items", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--working-set", type=int, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--prefix", required=True)
    args = ap.parse_args()
    try:
        out = measure(args)
    except Exception as e:  # reported in the JSON, never a traceback on stdout
        out = {"put": None, "get": None, "verified": 0, "mismatches": 0,
               "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
