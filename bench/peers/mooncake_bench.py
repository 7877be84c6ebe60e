#!/usr/bin/env python3
"""Mooncake Store driver for `gpucache-bench service`.

Starts, on 127.0.0.1 and free ports, the standalone HTTP metadata server, mooncake_master and a
separate mooncake_client process that holds the memory segment (the fair peer of a TCP service:
the data crosses a socket to another process), then for each (size, clients) point runs that many
worker processes (multiprocessing, so the GIL does not serialise them). Each worker registers one
value buffer, puts its share of distinct keys with put_from until the keys run out or the
deadline passes, waits for the others, then reads its own keys back with get_into until the
deadline. Every 16th GET is compared with what was put. With --batch N, each call moves N values
(batch_put_from / batch_get_into from a pool of the worker's values; see batch_worker).

Prints one JSON object on stdout (everything else goes to stderr or the log directory):
  {"peer": "mooncake", "version": ..., "points": [{"size": B, "clients": N,
   "put": {"ops", "bytes", "seconds", "p50_us", "p99_us", "errors"}, "get": {...},
   "verified": n, "mismatches": n, "error": null | "text"}]}

Every process it starts is in its own process group, so the caller can stop everything with one
kill of the group; it also stops them itself on exit, SIGTERM and SIGINT.
"""

import argparse
import atexit
import json
import mmap
import multiprocessing as mp
import os
import signal
import socket
import struct
import subprocess
import sys
import time

CHILDREN = []
VERIFY_EVERY = 16
# How long a worker retries its first put while the client's segment is being mounted.
MOUNT_WAIT_S = 20.0


def log(msg):
    print(f"mooncake_bench: {msg}", file=sys.stderr, flush=True)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_children():
    for proc in reversed(CHILDREN):
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + 3.0
    for proc in reversed(CHILDREN):
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    CHILDREN.clear()


def on_signal(signum, _frame):
    stop_children()
    sys.exit(128 + signum)


def start(name, argv, log_dir):
    out = open(os.path.join(log_dir, f"{name}.log"), "wb")
    log(f"starting {name}: {' '.join(argv)}")
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    CHILDREN.append(proc)
    return proc


def wait_port(proc, name, port, deadline_s):
    until = time.monotonic() + deadline_s
    while time.monotonic() < until:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"{name} did not listen on 127.0.0.1:{port} within {deadline_s} s")


def value_for(base, index):
    return struct.pack("<Q", index) + base[8:]


def percentile(sorted_us, p):
    if not sorted_us:
        return None
    rank = max(0, min(len(sorted_us) - 1, int(round(p / 100.0 * len(sorted_us) + 0.5)) - 1))
    return sorted_us[rank]


def connect(cfg, size):
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        "127.0.0.1",
        cfg["metadata_url"],
        0,  # no segment of its own: the data lives in the mooncake_client process
        max(64 << 20, 2 * size),
        "tcp",
        "",
        cfg["master_addr"],
    )
    if rc != 0:
        raise RuntimeError(f"setup returned {rc}")
    return store


def wait_mounted(store, probe, ptr, size):
    """Waits until a put can land (the client's segment is mounted), outside the timing."""
    until = time.monotonic() + MOUNT_WAIT_S
    while True:
        rc = store.put_from(probe, ptr, size)
        if rc == 0:
            store.remove(probe, True)
            return
        if time.monotonic() > until:
            raise RuntimeError(f"put_from never succeeded (last code {rc})")
        time.sleep(0.1)


def worker(wid, clients, size, key_count, seconds, point, cfg, barrier, results, batch):
    """One worker process: connects, runs its phases (one value per call, or `batch` per call),
    and puts what it measured (or its error) on `results`."""
    out = {"wid": wid, "put": None, "get": None, "verified": 0, "mismatches": 0, "error": None}
    store = None
    try:
        store = connect(cfg, size)
        body = batch_phases if batch else single_phases
        body(store, out, wid, clients, size, key_count, seconds, point, barrier, batch)
    except Exception as e:  # reported in the JSON, never a traceback on stdout
        out["error"] = f"worker {wid}: {e}"
        try:
            barrier.abort()
        except Exception:
            pass
    finally:
        try:
            if store is not None:
                store.close()
        except Exception:
            pass
    results.put(out)


def single_phases(store, out, wid, clients, size, key_count, seconds, point, barrier, _batch):
    """put_from / get_into of one value per call from one registered buffer."""
    buf = mmap.mmap(-1, size)
    import ctypes

    ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    rc = store.register_buffer(ptr, size)
    if rc != 0:
        raise RuntimeError(f"register_buffer returned {rc}")
    base = bytes((i * 131 + 7) & 0xFF for i in range(256)) * (size // 256 + 1)
    base = base[:size]
    buf[:] = base
    mine = list(range(wid, key_count, clients))

    wait_mounted(store, f"p{point}-probe-{wid}", ptr, size)

    barrier.wait(timeout=120)
    lat, errors, put_keys = [], 0, []
    t0 = time.perf_counter()
    deadline = t0 + seconds
    for i in mine:
        if time.perf_counter() >= deadline:
            break
        buf[0:8] = struct.pack("<Q", i)
        a = time.perf_counter()
        rc = store.put_from(f"p{point}-k{i}", ptr, size)
        lat.append((time.perf_counter() - a) * 1e6)
        if rc == 0:
            put_keys.append(i)
        else:
            errors += 1
    t1 = time.perf_counter()
    out["put"] = {"ops": len(lat), "ok": len(put_keys), "start": t0, "end": t1, "lat": lat,
                  "errors": errors}

    barrier.wait(timeout=120)
    lat, errors, n = [], 0, 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while put_keys and time.perf_counter() < deadline:
        i = put_keys[n % len(put_keys)]
        n += 1
        a = time.perf_counter()
        rc = store.get_into(f"p{point}-k{i}", ptr, size)
        lat.append((time.perf_counter() - a) * 1e6)
        if rc != size:
            errors += 1
            continue
        if n % VERIFY_EVERY == 1:
            if buf[:] == value_for(base, i):
                out["verified"] += 1
            else:
                out["mismatches"] += 1
    t1 = time.perf_counter()
    out["get"] = {"ops": len(lat), "ok": len(lat) - errors, "start": t0, "end": t1,
                  "lat": lat, "errors": errors}
    barrier.wait(timeout=120)
    if wid == 0:
        store.remove_all(True)
    store.unregister_buffer(ptr)


def batch_phases(store, out, wid, clients, size, key_count, seconds, point, barrier, batch):
    """batch_put_from / batch_get_into of `batch` values per call: a source pool of this
    worker's keys (each value stamped with its index) and one destination of a batch, both in
    one registered buffer. Latencies are per batch; ops count batches. After the
    GET phase, the last batch read is read again into a zeroed destination and compared."""
    mine = list(range(wid, key_count, clients))
    batches = max(1, len(mine) // batch)
    mine = mine[:batches * batch]
    pool_bytes = len(mine) * size
    buf = mmap.mmap(-1, pool_bytes + batch * size)
    import ctypes

    ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    rc = store.register_buffer(ptr, pool_bytes + batch * size)
    if rc != 0:
        raise RuntimeError(f"register_buffer returned {rc}")
    base = bytes((i * 131 + 7) & 0xFF for i in range(256)) * (size // 256 + 1)
    base = base[:size]
    for slot, i in enumerate(mine):
        buf[slot * size:(slot + 1) * size] = value_for(base, i)
    dst = pool_bytes
    buf[dst:] = b"\x01" * (batch * size)
    names = [f"p{point}-k{i}" for i in mine]
    key_batches = [names[j * batch:(j + 1) * batch] for j in range(batches)]
    src_ptrs = [[ptr + (j * batch + s) * size for s in range(batch)] for j in range(batches)]
    dst_ptrs = [ptr + dst + s * size for s in range(batch)]
    sizes = [size] * batch
    wait_mounted(store, f"p{point}-probe-{wid}", ptr + dst, size)

    barrier.wait(timeout=120)
    lat, errors, stored = [], 0, 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    for j in range(batches):
        if time.perf_counter() >= deadline:
            break
        a = time.perf_counter()
        rcs = store.batch_put_from(key_batches[j], src_ptrs[j], sizes)
        lat.append((time.perf_counter() - a) * 1e6)
        if all(rc == 0 for rc in rcs):
            stored += 1
        else:
            errors += 1
            break
    t1 = time.perf_counter()
    out["put"] = {"ops": len(lat), "ok": stored * batch, "start": t0, "end": t1, "lat": lat,
                  "errors": errors}

    barrier.wait(timeout=120)
    lat, errors, ok, j = [], 0, 0, 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while stored and time.perf_counter() < deadline:
        a = time.perf_counter()
        got = store.batch_get_into(key_batches[j % stored], dst_ptrs, sizes)
        lat.append((time.perf_counter() - a) * 1e6)
        if got.count(size) == batch:
            ok += batch
        else:
            errors += 1
            break
        j += 1
    t1 = time.perf_counter()
    out["get"] = {"ops": len(lat), "ok": ok, "start": t0, "end": t1, "lat": lat,
                  "errors": errors}
    if stored:
        last = (j - 1) % stored if j else 0
        buf[dst:] = bytes(batch * size)
        got = store.batch_get_into(key_batches[last], dst_ptrs, sizes)
        at = last * batch * size
        if got.count(size) == batch and buf[dst:] == buf[at:at + batch * size]:
            out["verified"] += batch
        else:
            out["mismatches"] += batch
    barrier.wait(timeout=120)
    if wid == 0:
        store.remove_all(True)
    store.unregister_buffer(ptr)


def summarize(parts, size, which):
    parts = [p[which] for p in parts if p.get(which)]
    if not parts:
        return None
    lat = sorted(x for p in parts for x in p["lat"])
    ok = sum(p["ok"] for p in parts)
    seconds = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    return {
        "ops": sum(p["ops"] for p in parts),
        "bytes": ok * size,
        "seconds": seconds,
        "p50_us": percentile(lat, 50),
        "p99_us": percentile(lat, 99),
        "errors": sum(p["errors"] for p in parts),
    }


def run_point(point, size, clients, args, cfg):
    key_count = max(clients * max(4, args.batch), args.working_set // size)
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(clients)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=worker,
                    args=(w, clients, size, key_count, args.seconds, point, cfg, barrier, results,
                          args.batch))
        for w in range(clients)
    ]
    for p in procs:
        p.start()
    parts = []
    budget = time.monotonic() + 2 * args.seconds + MOUNT_WAIT_S + 120
    while len(parts) < clients and time.monotonic() < budget:
        try:
            parts.append(results.get(timeout=1.0))
        except Exception:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    errors = [p["error"] for p in parts if p["error"]]
    if len(parts) < clients:
        errors.append(f"{clients - len(parts)} worker(s) gave no result")
    return {
        "size": size,
        "clients": clients,
        "put": summarize(parts, size, "put"),
        "get": summarize(parts, size, "get"),
        "verified": sum(p["verified"] for p in parts),
        "mismatches": sum(p["mismatches"] for p in parts),
        "error": "; ".join(errors) if errors else None,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", required=True, help="folder holding the mooncake binaries")
    ap.add_argument("--sizes", required=True, help="comma-separated value sizes in bytes")
    ap.add_argument("--clients", required=True, help="comma-separated client counts")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--working-set", type=int, default=256 << 20)
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--batch", type=int, default=0,
                    help="values per batch_put_from / batch_get_into call (0: put_from / "
                         "get_into one value per call)")
    args = ap.parse_args()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    atexit.register(stop_children)
    os.makedirs(args.log_dir, exist_ok=True)

    sizes = [int(s) for s in args.sizes.split(",") if s]
    clients_list = [int(c) for c in args.clients.split(",") if c]
    segment = 2 * args.working_set + 2 * max(sizes) * max(clients_list) + (64 << 20)
    meta_port, master_port, metrics_port, client_port = (free_port() for _ in range(4))
    b = args.bin_dir
    meta = start("metadata", [os.path.join(b, "mooncake_http_metadata_server"),
                              "--host", "127.0.0.1", "--port", str(meta_port),
                              "--log-level", "WARNING"], args.log_dir)
    wait_port(meta, "mooncake_http_metadata_server", meta_port, 30)
    master = start("master", [os.path.join(b, "mooncake_master"),
                              f"--rpc_port={master_port}", "--rpc_address=127.0.0.1",
                              f"--metrics_port={metrics_port}", "--metrics_host=127.0.0.1",
                              "--enable_http_metadata_server=false",
                              "--enable_metric_reporting=false"], args.log_dir)
    wait_port(master, "mooncake_master", master_port, 30)
    metadata_url = f"http://127.0.0.1:{meta_port}/metadata"
    client = start("client", [os.path.join(b, "mooncake_client"),
                              "--host=127.0.0.1", f"--port={client_port}",
                              f"--master_server_address=127.0.0.1:{master_port}",
                              f"--metadata_server={metadata_url}",
                              f"--global_segment_size={segment}", "--protocol=tcp"],
                   args.log_dir)
    wait_port(client, "mooncake_client", client_port, 30)
    cfg = {"metadata_url": metadata_url, "master_addr": f"127.0.0.1:{master_port}"}

    version = None
    try:
        from importlib.metadata import version as pkg_version
        version = pkg_version("mooncake-transfer-engine-non-cuda")
    except Exception:
        pass
    points = []
    n = 0
    for size in sizes:
        for clients in clients_list:
            log(f"point size={size} clients={clients}")
            points.append(run_point(n, size, clients, args, cfg))
            n += 1
            if client.poll() is not None:
                log("mooncake_client exited; stopping")
                break
    print(json.dumps({"peer": "mooncake", "version": version, "segment_bytes": segment,
                      "points": points}), flush=True)
    stop_children()


if __name__ == "__main__":
    main()
