"""Fixtures of the engine tests (the server, client and names come from python/tests)."""

from __future__ import annotations

import asyncio
import threading

import pytest

LOOP_STOP_S = 30.0


@pytest.fixture(scope="module")
def loop():
    """An asyncio loop on its own thread, as LMCache runs its remote backends on one."""
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, name="lmcache-loop", daemon=True)
    t.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    t.join(LOOP_STOP_S)
    lp.close()
