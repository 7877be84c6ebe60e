"""GPUCache's Mooncake sidecar: one MooncakeDistributedStore behind a Unix socket.

Started by the Rust adapter (mooncake/src/sidecar.rs), which embeds this file. It sets
up one store client against a running master and metadata server, registers one buffer, then
listens on --socket, accepts exactly one connection and answers frames until that connection
closes (then it exits). The frame layout is documented in mooncake/src/lib.rs.

Answers are the SDK's raw integers. This file interprets nothing: what a code means is decided
in results.rs. Status 1 means the SDK raised after the call was entered; status 2 means the
request was refused here before any SDK call.
"""

import argparse
import ctypes
import mmap
import os
import socket
import struct
import sys

OP_PUT, OP_GET, OP_SIZE, OP_EXISTS, OP_REMOVE = 1, 2, 3, 4, 5
STATUS_CODE, STATUS_RAISED, STATUS_REFUSED = 0, 1, 2
REQUEST_HEAD = struct.Struct("<BHQ")
KEY_BYTES_MAX = 512


def log(msg):
    print(f"mooncake sidecar: {msg}", file=sys.stderr, flush=True)


def read_exact(conn, view):
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def send_reply(conn, status, code, payload=b""):
    body = struct.pack("<Bq", status, code)
    conn.sendall(struct.pack("<I", len(body) + len(payload)) + body)
    if payload:
        conn.sendall(payload)


def serve(conn, store, buf, ptr, buffer_bytes):
    body_max = REQUEST_HEAD.size + KEY_BYTES_MAX + buffer_bytes
    body = bytearray(body_max)
    view = memoryview(body)
    prefix = bytearray(4)
    while True:
        if not read_exact(conn, memoryview(prefix)):
            return
        (length,) = struct.unpack("<I", prefix)
        if length < REQUEST_HEAD.size or length > body_max:
            log(f"frame of {length} bytes is outside [{REQUEST_HEAD.size}, {body_max}]; closing")
            return
        if not read_exact(conn, view[:length]):
            return
        op, key_len, argument = REQUEST_HEAD.unpack_from(body, 0)
        key_end = REQUEST_HEAD.size + key_len
        if key_len == 0 or key_len > KEY_BYTES_MAX or key_end > length:
            send_reply(conn, STATUS_REFUSED, 0)
            continue
        key = bytes(view[REQUEST_HEAD.size:key_end]).decode("ascii", "replace")
        payload_len = length - key_end
        if op == OP_PUT:
            if payload_len == 0:
                send_reply(conn, STATUS_REFUSED, 0)
                continue
            buf[:payload_len] = view[key_end:length]
            call = lambda: store.put_from(key, ptr, payload_len)
        elif op == OP_GET:
            if argument == 0 or argument > buffer_bytes or payload_len:
                send_reply(conn, STATUS_REFUSED, 0)
                continue
            call = lambda: store.get_into(key, ptr, argument)
        elif op == OP_SIZE:
            call = lambda: store.get_size(key)
        elif op == OP_EXISTS:
            call = lambda: store.is_exist(key)
        elif op == OP_REMOVE:
            call = lambda: store.remove(key)
        else:
            send_reply(conn, STATUS_REFUSED, 0)
            continue
        try:
            code = int(call())
        except Exception as e:  # the SDK raised after the call was entered
            log(f"op {op} raised: {e!r}")
            send_reply(conn, STATUS_RAISED, 0)
            continue
        if op == OP_GET and code > 0:
            send_reply(conn, STATUS_CODE, code, bytes(buf[: min(code, argument)]))
        else:
            send_reply(conn, STATUS_CODE, code)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--metadata-url", required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--local-host", default="127.0.0.1")
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--buffer-bytes", type=int, required=True)
    ap.add_argument("--segment-bytes", type=int, default=0)
    args = ap.parse_args()

    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        args.local_host,
        args.metadata_url,
        args.segment_bytes,
        max(64 << 20, 2 * args.buffer_bytes),
        args.protocol,
        "",
        args.master,
    )
    if rc != 0:
        log(f"setup returned {rc}")
        sys.exit(3)
    buf = mmap.mmap(-1, args.buffer_bytes)
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    rc = store.register_buffer(ptr, args.buffer_bytes)
    if rc != 0:
        log(f"register_buffer returned {rc}")
        sys.exit(4)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(args.socket)
    listener.listen(1)
    log(f"ready on {args.socket}")
    conn, _ = listener.accept()
    listener.close()
    os.unlink(args.socket)
    try:
        serve(conn, store, buf, ptr, args.buffer_bytes)
    finally:
        conn.close()
        # Exit without tearing the SDK down: its threads may still be running after a raise.
        os._exit(0)


if __name__ == "__main__":
    main()
