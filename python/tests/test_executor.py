"""The Rust executor through Python: operation ids, per-key results, retirement facts, the
pressure snapshot, health epochs after an outage, refusals, and close's restart report."""

from __future__ import annotations

import os
import time

import pytest

import conftest

gpucache = pytest.importorskip("gpucache")

RESULT_PATIENCE_S = 30.0


def wait_result(ex, op, seen):
    """The result of `op`, polling (each poll waits for results) within RESULT_PATIENCE_S;
    other results polled meanwhile land in `seen`."""
    deadline = time.monotonic() + RESULT_PATIENCE_S
    while op not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no result for operation {op} within {RESULT_PATIENCE_S} s"
        polled = ex.poll(timeout_s=min(left, 5.0))
        for r in polled["results"]:
            seen[r["operation"]] = r
    return seen.pop(op)


def test_put_query_get_through_the_executor(client, unique):
    ex = client.executor(allocation_bytes=1 << 20, slot_bytes=64 << 10)
    assert ex.allocation_bytes == 1 << 20 and ex.slot_bytes == 64 << 10
    seen = {}
    block = os.urandom(4096)
    ex.write(0, 4096, block)
    put = ex.submit_put([unique], [(0, 4096)])
    r = wait_result(ex, put, seen)
    assert r["kind"] == "put" and r["ending"] == "ran" and r["retired"] is True
    assert r["keys"] == [{"ok": True, "result": "written", "bytes": 4096}]
    again = wait_result(ex, ex.submit_put([unique], [(0, 4096)]), seen)
    assert again["keys"][0]["result"] == "already_stored" and again["keys"][0]["ok"]
    q = wait_result(ex, ex.submit_query([unique, unique + "-absent"]), seen)
    assert q["keys"][0] == {"ok": True, "result": "found", "bytes": 4096}
    assert q["keys"][1]["ok"] is False and q["keys"][1]["reason"] == "not_found"
    get = ex.submit_get([unique, unique + "-absent", unique],
                        [(65536, 4096), (131072, 4096), (196608, 8192)])
    g = wait_result(ex, get, seen)
    assert g["keys"][0] == {"ok": True, "result": "read", "bytes": 4096}
    assert g["keys"][1]["result"] == "object_failed" and g["keys"][1]["reason"] == "absent"
    # Exactly the range's byte count or a failure: an 8 KiB range for a 4 KiB block.
    assert g["keys"][2]["ok"] is False and g["keys"][2]["reason"] == "short_read"
    assert ex.read(65536, 4096) == block
    into = bytearray(4096 + 7)
    ex.read_into(65536, 4096, into)
    assert bytes(into[:4096]) == block and into[4096:] == bytes(7)
    with pytest.raises(ValueError):
        ex.read_into(65536, 4096, bytearray(4095))  # too small: nothing is written
    assert client.get(unique) == block  # the client reads what the executor wrote
    p = ex.poll()
    assert p["health"]["state"] == "healthy" and p["health"]["epoch"] == 0
    assert p["pressure"]["running_jobs"] == 0 and p["quarantined"] == []
    report = ex.close()
    assert report["restart_required"] is False and report["workers_stuck"] == 0
    with pytest.raises(gpucache.RefusedError) as e:
        ex.submit_query([unique])
    assert e.value.reason == "closed"
    with pytest.raises(gpucache.RefusedError):
        ex.close()


def test_submissions_are_refused_with_reasons(client):
    ex = gpucache.Executor(client, 1 << 16, slot_bytes=1 << 12, keys_per_job_max=2)
    try:
        with pytest.raises(gpucache.RefusedError) as e:
            ex.submit_get(["a", "b"], [(0, 16), (4090, 16)])  # the second crosses a slot
        assert e.value.reason == "bad_range" and e.value.index == 1
        with pytest.raises(gpucache.RefusedError) as e:
            ex.submit_query([])
        assert e.value.reason == "no_keys"
        with pytest.raises(gpucache.RefusedError) as e:
            ex.submit_query(["a", "b", "c"])
        assert e.value.reason == "too_many_keys"
        with pytest.raises(ValueError):
            ex.submit_put(["a"], [(0, 1), (1, 1)])
        assert ex.cancel(987654) == "not_outstanding"
        with pytest.raises(ValueError):
            gpucache.Executor(client, 1000, slot_bytes=300)
    finally:
        ex.close()


def test_an_outage_opens_a_health_epoch_and_refuses_work(tmp_path):
    proc, srv = conftest.start_server(tmp_path)
    try:
        c = gpucache.Client(srv.native, local=False, timeout_s=5.0)
        ex = c.executor(allocation_bytes=1 << 16, cooldown_ms=600_000)
        seen = {}
        ok = wait_result(ex, ex.submit_query(["x"]), seen)
        assert ok["keys"][0]["reason"] == "not_found"
    finally:
        conftest.stop(proc)
    r = wait_result(ex, ex.submit_query(["x"]), seen)
    assert r["keys"][0]["ok"] is False and r["keys"][0]["reason"] == "store"
    assert r["retired"] is True  # over TCP a failure never leaves the server writing
    h = ex.poll()["health"]
    assert h["state"] == "cooling_down" and h["epoch"] == 1
    with pytest.raises(gpucache.RefusedError) as e:
        ex.submit_query(["x"])
    assert e.value.reason == "unhealthy"
    report = ex.close()
    assert report["restart_required"] is False


def test_close_waits_for_a_poll_of_another_thread(client):
    import threading

    ex = client.executor(allocation_bytes=1 << 20, slot_bytes=64 << 10)
    polling = threading.Event()
    outcome = {}

    def poll():
        polling.set()
        try:
            outcome["poll"] = ex.poll(timeout_s=1.0)
        except gpucache.RefusedError as e:  # the close came first
            outcome["poll"] = e.reason

    t = threading.Thread(target=poll)
    t.start()
    assert polling.wait(timeout=10.0)
    # No deadline to spare: a poll that holds the core makes this close refuse, and the core
    # stays for the next close; one that does not hold it lets it through.
    try:
        first = ex.close(join_deadline_s=0.0)
    except gpucache.UnavailableError:
        first = None
    # With time to spare the close waits for the poll and succeeds.
    report = first if first is not None else ex.close(join_deadline_s=10.0)
    t.join(timeout=10.0)
    assert not t.is_alive()
    assert report["restart_required"] is False
    assert outcome["poll"] == "closed" or outcome["poll"]["results"] == []
