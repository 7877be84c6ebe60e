"""Starting and stopping `gpucache serve` for the Python tests: the server listens on the ports
its configuration names (port 0: the system picks), is ready when it prints its start line
(within START_PATIENCE_S, its fields returned), and is stopped by its PID.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

START_PATIENCE_S = 60.0
STOP_PATIENCE_S = 30.0
START_LINES_MAX = 200


REPO = Path(__file__).resolve().parents[2]


def server_binary() -> Path:
    """$GPUCACHE_BIN, else $CARGO_TARGET_DIR/debug/gpucache, else target/debug/gpucache of this
    checkout."""
    if os.environ.get("GPUCACHE_BIN"):
        # Relative to where pytest was started (the servers run in their own directories).
        return Path(os.environ["GPUCACHE_BIN"]).resolve()
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    if not target.is_absolute():
        target = REPO / target
    return target / "debug" / "gpucache"


def fields_of(line: str) -> dict:
    out = {}
    for word in line.split():
        if "=" in word:
            k, v = word.split("=", 1)
            out[k] = v
    return out


def launch(binary: Path, config: Path, workdir: Path) -> tuple[subprocess.Popen, dict]:
    """Runs `binary serve --config config` in `workdir`; returns the process and the fields of
    its start line (`native`, `resp`, `local`, ...) once it printed it."""
    if not binary.exists():
        pytest.fail(f"{binary} is missing: build it with `cargo build -p gpucache-cli` "
                    "(or set GPUCACHE_BIN)")
    proc = subprocess.Popen(
        [str(binary), "serve", "--config", str(config)],
        cwd=workdir,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue = queue.Queue(maxsize=START_LINES_MAX)

    def drain():
        # Keeps reading the log so the server never blocks on it; keeps the first lines.
        assert proc.stderr is not None
        for line in proc.stderr:
            try:
                lines.put_nowait(line.rstrip("\n"))
            except queue.Full:
                pass
        try:
            lines.put_nowait(None)
        except queue.Full:
            pass

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + START_PATIENCE_S
    seen = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            stop(proc)
            pytest.fail(f"serve printed no start line within {START_PATIENCE_S} s:\n"
                        + "\n".join(seen))
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            continue
        if line is None:
            proc.wait(timeout=STOP_PATIENCE_S)
            pytest.fail("serve exited before it listened:\n" + "\n".join(seen))
        seen.append(line)
        if "listening native=" in line:
            return proc, fields_of(line)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM by PID, then SIGKILL when it has not exited within STOP_PATIENCE_S."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_PATIENCE_S)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_PATIENCE_S)


def pause(pid: int, limit_s: float = 30.0) -> None:
    """SIGSTOP `pid`, returning once every thread of it is stopped (state T): the signal takes
    effect on each thread only when that thread next runs, which on a busy machine can come
    after the next request has arrived and been answered."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + limit_s
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                continue  # a thread that ended
        if states and all(s in ("T", "t") for s in states):
            return
        assert time.monotonic() < deadline, f"server {pid} not stopped: {states}"
        os.sched_yield()
