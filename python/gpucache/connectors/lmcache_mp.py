"""LMCache multiprocess-mode L2 adapter backed by a GPUCache server.

LMCache's multiprocess server (``lmcache server``) keeps its L1 in host memory and moves
objects to and from L2 storage through L2 adapters (``L2AdapterInterface`` in
``lmcache.v1.distributed.l2_adapters.base``). Its ``plugin`` adapter type imports an adapter
class from any module: this module's ``GPUCacheL2Adapter``, configured by
``GPUCacheL2AdapterConfig`` (found by LMCache as ``class_name + "Config"``). A new user starts
``gpucache serve`` and then the LMCache server with::

    lmcache server --l1-size-gb 20 --eviction-policy LRU \\
        --l2-adapter '{"type": "plugin", "module_path": "gpucache.connectors.lmcache_mp",
                       "class_name": "GPUCacheL2Adapter",
                       "adapter_params": {"url": "gpucache://127.0.0.1:7470?tenant=default"}}'

``adapter_params`` takes ``url`` (required: ``gpucache://HOST:PORT?...`` or a
``gpucache+etcd://...`` cluster, see ``gpucache.connectors._url``) and ``deadline_s``
(optional, default 10, at most 15): the time from LMCache's submit of a store, lookup or load
within which the adapter reports that task's result. LMCache itself sets no deadline on an L2
task: its prefetch waits for every lookup and load it submitted, and removing an adapter at
run time waits 30 s for the adapter's tasks to drain; ``deadline_s`` is held at half of that.
The address's ``timeout_s`` is lowered to ``deadline_s``. Any other field, a malformed URL or
a server that cannot be reached while the adapter is made raises ``GPUCacheConfigError``
(a ``ValueError``), which stops LMCache's start with the reason.

What LMCache sees:

* store: the objects' bytes are copied out of L1 into the adapter's own buffer and put under
  their keys (create-only: a key already held counts as stored). The task succeeds when every
  key is held; otherwise (refusal, unreachable server, past the deadline) it fails as a whole,
  as LMCache's interface reports stores.
* lookup: a key the server holds is a hit. GPUCache takes no lock: a block evicted between
  lookup and load is a miss of the load. A failed call is a miss, never an error.
* load: each key is read into the adapter's own buffer and copied into LMCache's L1 object only
  when exactly the object's size came back, and only while LMCache still waits for the task;
  any other length is a miss.

Every task is reported at its deadline at the latest (a watchdog reports it with what is known
then: a failed store, the hits so far of a lookup or load); a server call still running then
goes on in the adapter's own buffers and touches no L1 memory afterwards, and no buffer is
allocated for a task that was already reported. Keys: one ``gpucache.Identity`` per (model,
kv rank, object group, cache salt) of LMCache's ``ObjectKey``; the block is the key's chunk
hash. GPUCache keeps its own capacity and eviction, so the adapter declares no capacity to
LMCache's L2 eviction.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import gpucache
from gpucache.connectors import _url
from gpucache.connectors.lmcache import LAYOUT_VERSION, GPUCacheConfigError, IdentityCache

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

logger = logging.getLogger(__name__)

# LMCache's StorageManager.delete_l2_adapter waits this long (its default) for an adapter's
# in-flight tasks to drain.
LMCACHE_DRAIN_S = 30.0
DEADLINE_S_DEFAULT = 10.0
DEADLINE_S_MAX = LMCACHE_DRAIN_S / 2
CONFIG_FIELDS = ("url", "deadline_s")
# Worker threads for stores, and for lookups and loads (kept apart so stores never hold up a
# prefetch).
STORE_THREADS = 4
READ_THREADS = 4
# Tasks submitted and not yet reported, per kind (store / lookup+load); one more fails at once.
TASKS_INFLIGHT_MAX = 256
# Results reported and not yet collected by LMCache, per kind; the oldest is dropped past it.
RESULTS_KEPT_MAX = 4096
# Most bytes one server call stages in the adapter's own buffer (an object larger than this
# goes alone).
STAGING_BYTES_MAX = 256 << 20
# Most keys one server call carries (one wire frame).
CALL_KEYS_MAX = min(gpucache.BATCH_ITEMS_MAX, gpucache.BATCH_KEYS_MAX)
# close() waits this much past the call timeout for a worker still in a server call.
CLOSE_SLACK_S = 2.0
# The watchdog's wait when nothing is outstanding.
WATCHDOG_IDLE_S = 1.0
LAYOUT_PREFIX = "lmcache-mp"
SALT_DOMAIN_PREFIX = "lmcache-salt:"

STORE, LOOKUP, LOAD = "store", "lookup", "load"


class GPUCacheL2AdapterConfig(L2AdapterConfigBase):
    """``adapter_params`` of the plugin adapter: ``url`` and optional ``deadline_s``."""

    def __init__(self, url: str, deadline_s: float = DEADLINE_S_DEFAULT):
        self.url = url
        self.deadline_s = deadline_s
        try:
            self.address = _url.parse(url)
        except ValueError as e:
            raise GPUCacheConfigError(f"GPUCache L2 adapter: {e}") from None

    @classmethod
    def from_dict(cls, d: dict) -> "GPUCacheL2AdapterConfig":
        if not isinstance(d, dict):
            raise GPUCacheConfigError(
                f"GPUCache L2 adapter: adapter_params must be an object, not {d!r}"
            )
        unknown = sorted(k for k in d if k not in CONFIG_FIELDS and k != "type")
        if unknown:
            raise GPUCacheConfigError(
                f"GPUCache L2 adapter: unknown adapter_params field(s) {unknown}; "
                f"known: {list(CONFIG_FIELDS)}"
            )
        url = d.get("url")
        if not isinstance(url, str) or not url:
            raise GPUCacheConfigError(
                'GPUCache L2 adapter: adapter_params needs "url": "gpucache://HOST:PORT"'
            )
        deadline_s = d.get("deadline_s", DEADLINE_S_DEFAULT)
        if (
            isinstance(deadline_s, bool)
            or not isinstance(deadline_s, (int, float))
            or not 0 < deadline_s <= DEADLINE_S_MAX
        ):
            raise GPUCacheConfigError(
                f"GPUCache L2 adapter: deadline_s must be a number of seconds in "
                f"(0, {DEADLINE_S_MAX:g}] (half of LMCache's {LMCACHE_DRAIN_S:g} s drain), "
                f"not {deadline_s!r}"
            )
        return cls(url=url, deadline_s=float(deadline_s))

    @classmethod
    def help(cls) -> str:
        return (
            "GPUCache L2 adapter (type plugin, module_path gpucache.connectors.lmcache_mp, "
            "class_name GPUCacheL2Adapter) adapter_params:\n"
            "- url (str): gpucache://HOST:PORT?tenant=NAME&timeout_s=S or "
            "gpucache+etcd://HOST:PORT[,...]/CLUSTER?... (required)\n"
            f"- deadline_s (float): each task is reported within this many seconds of its "
            f"submit (default {DEADLINE_S_DEFAULT:g}, at most {DEADLINE_S_MAX:g})"
        )


@dataclasses.dataclass(eq=False)
class _Task:
    """One submitted store, lookup or load. ``lock`` guards ``done`` and every access to
    LMCache's memory objects: once ``done`` is set nothing touches them again."""

    task_id: int
    kind: str
    keys: List[Any]
    objects: Optional[List[Any]]
    deadline: float
    found: List[bool]
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    done: bool = False


class GPUCacheL2Adapter(L2AdapterInterface):
    """LMCache's ``L2AdapterInterface`` over a ``gpucache.Client`` (see the module's doc)."""

    def __init__(self, config: Any, l1_memory_desc: Any = None) -> None:
        super().__init__(max_capacity_bytes=0)
        if not isinstance(config, GPUCacheL2AdapterConfig):
            config = GPUCacheL2AdapterConfig.from_dict(config)
        self.config = config
        self.deadline_s = config.deadline_s
        self.address = dataclasses.replace(
            config.address, timeout_s=min(config.address.timeout_s, config.deadline_s)
        )
        try:
            self.client = self.address.connect(client_name="gpucache-lmcache-mp")
        except gpucache.Error as e:
            raise GPUCacheConfigError(
                f"GPUCache L2 adapter: cannot reach the GPUCache server of {config.url!r} "
                f"({type(e).__name__}: {e})"
            ) from None
        self._notifiers = {k: create_event_notifier() for k in (STORE, LOOKUP, LOAD)}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._next_id = 0
        self._closing = False
        self._fds_closed = False
        # Outstanding tasks in submit order, which is deadline order (one deadline_s for all).
        self._outstanding: "collections.OrderedDict[int, _Task]" = collections.OrderedDict()
        self._results: Dict[str, "collections.OrderedDict[int, Any]"] = {
            k: collections.OrderedDict() for k in (STORE, LOOKUP, LOAD)
        }
        self._identities = IdentityCache()
        self._stats = collections.Counter()
        self._last_error = ""
        self._queues = {
            STORE: queue.Queue(maxsize=TASKS_INFLIGHT_MAX),
            LOOKUP: queue.Queue(maxsize=TASKS_INFLIGHT_MAX),
        }
        self._threads: List[threading.Thread] = []
        for q, n, name in (
            (self._queues[STORE], STORE_THREADS, "store"),
            (self._queues[LOOKUP], READ_THREADS, "read"),
        ):
            for i in range(n):
                t = threading.Thread(
                    target=self._work, args=(q,), name=f"gpucache-l2-{name}-{i}", daemon=True
                )
                t.start()
                self._threads.append(t)
        self._watchdog = threading.Thread(
            target=self._watch, name="gpucache-l2-watchdog", daemon=True
        )
        self._watchdog.start()

    # ---- keys -------------------------------------------------------------------------------

    def _identity(self, key: Any) -> gpucache.Identity:
        who = (key.model_name, key.kv_rank, key.object_group_id, key.cache_salt)
        return self._identities.get(who, lambda: gpucache.Identity(
            tenant=self.address.tenant,
            model=key.model_name,
            layout=f"{LAYOUT_PREFIX}-r{key.kv_rank}-g{key.object_group_id}",
            layout_version=LAYOUT_VERSION,
            trust_domain=SALT_DOMAIN_PREFIX + key.cache_salt,
        ))

    def gpucache_key(self, key: Any) -> gpucache.Key:
        """The GPUCache key an LMCache ``ObjectKey`` is stored under."""
        return self._identity(key).chain_keys([bytes(key.chunk_hash)])[0]

    # ---- submit / report --------------------------------------------------------------------

    def _submit(self, kind: str, keys: Sequence[Any], objects: Optional[Sequence[Any]]) -> int:
        keys = list(keys)
        if objects is not None:
            objects = list(objects)
            if len(objects) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        with self._lock:
            task_id = self._next_id
            self._next_id += 1
            task = _Task(
                task_id, kind, keys, objects, time.monotonic() + self.deadline_s,
                [False] * len(keys),
            )
            closing = self._closing
            if not closing:
                self._outstanding[task_id] = task
                self._wake.notify()
        if closing:
            self._report(task, "closed")
            return task_id
        try:
            self._queues[STORE if kind == STORE else LOOKUP].put_nowait(task)
        except queue.Full:
            self._report(task, "too many tasks in flight")
        return task_id

    def _report(self, task: _Task, failure: Optional[str] = None) -> bool:
        """Reports the task once (later calls do nothing): a store succeeds only without a
        failure and with every key held; a lookup or load reports the keys found so far."""
        with task.lock:
            if task.done:
                return False
            task.done = True
            objects, task.objects = task.objects, None
        if task.kind == STORE:
            ok = failure is None and all(task.found)
            nbytes = sum(o.get_size() for o in objects) if ok and objects else 0
            result: Any = L2StoreResult(ok, nbytes)
        else:
            result = Bitmap(len(task.keys))
            for i, hit in enumerate(task.found):
                if hit:
                    result.set(i)
        if failure is not None:
            logger.warning(
                "GPUCache L2 %s task %d (%d keys): %s", task.kind, task.task_id,
                len(task.keys), failure,
            )
        with self._lock:
            self._outstanding.pop(task.task_id, None)
            self._stats[f"{task.kind}_{'failed' if failure else 'done'}"] += 1
            kept = self._results[task.kind]
            kept[task.task_id] = result
            while len(kept) > RESULTS_KEPT_MAX:
                dropped, _ = kept.popitem(last=False)
                logger.warning("GPUCache L2 %s result %d never collected: dropped",
                               task.kind, dropped)
            # After close() the event fds are gone: results are then only read by query.
            if not self._fds_closed:
                self._notifiers[task.kind].notify()
        return True

    def _watch(self) -> None:
        """Reports every task still outstanding at its deadline."""
        while True:
            with self._lock:
                if self._closing:
                    return
                first = next(iter(self._outstanding.values()), None)
                now = time.monotonic()
                if first is None or first.deadline > now:
                    wait = WATCHDOG_IDLE_S if first is None else first.deadline - now
                    self._wake.wait(timeout=min(wait, WATCHDOG_IDLE_S))
                    continue
            self._report(first, f"not finished within deadline_s={self.deadline_s:g}")

    # ---- workers ----------------------------------------------------------------------------

    def _work(self, q: queue.Queue) -> None:
        while True:
            try:
                task = q.get(timeout=WATCHDOG_IDLE_S)
            except queue.Empty:
                if self._closing:
                    return
                continue
            if task is None:
                return
            try:
                failure = {STORE: self._store, LOOKUP: self._lookup, LOAD: self._load}[
                    task.kind
                ](task)
            except Exception as e:  # never leave a task unreported
                logger.exception("GPUCache L2 %s task %d failed", task.kind, task.task_id)
                failure = f"{type(e).__name__}: {e}"
            self._report(task, failure)

    def _live(self, task: _Task) -> bool:
        return not task.done and time.monotonic() < task.deadline

    def _note_error(self, e: Exception) -> str:
        text = f"{type(e).__name__}: {e}"
        with self._lock:
            self._last_error = text
            self._stats["call_errors"] += 1
        return text

    @staticmethod
    def _groups(sizes: Sequence[int]) -> List[Tuple[int, int]]:
        """[start, end) index ranges: at most CALL_KEYS_MAX keys and STAGING_BYTES_MAX bytes
        each (one larger object alone)."""
        out, start, total = [], 0, 0
        for i, size in enumerate(sizes):
            if i > start and (i - start >= CALL_KEYS_MAX or total + size > STAGING_BYTES_MAX):
                out.append((start, i))
                start, total = i, 0
            total += size
        if start < len(sizes):
            out.append((start, len(sizes)))
        return out

    @staticmethod
    def _view(obj: Any) -> Optional[memoryview]:
        """A byte view of an L1 object in host memory, or None."""
        raw = getattr(obj, "raw_tensor", None)
        if raw is None or raw.device.type != "cpu":
            return None
        view = obj.byte_array
        return (view if isinstance(view, memoryview) else memoryview(view)).cast("B")

    def _lookup(self, task: _Task) -> Optional[str]:
        for start, end in self._groups([0] * len(task.keys)):
            if not self._live(task):
                return None
            try:
                held = self.client.batch_exists(
                    [self.gpucache_key(k) for k in task.keys[start:end]]
                )
            except gpucache.Error as e:
                return f"lookup failed, reported as misses ({self._note_error(e)})"
            with task.lock:
                if task.done:
                    return None
                for i, h in enumerate(held):
                    task.found[start + i] = bool(h)
        return None

    def _load(self, task: _Task) -> Optional[str]:
        with task.lock:
            if task.done:
                return None
            sizes = [o.get_size() for o in task.objects]
        for start, end in self._groups(sizes):
            if not self._live(task):
                return None
            want = sizes[start:end]
            staging = memoryview(bytearray(sum(want)))
            views, at = [], 0
            for n in want:
                views.append(staging[at : at + n])
                at += n
            keys = [self.gpucache_key(k) for k in task.keys[start:end]]
            try:
                got = self.client.batch_get_into(keys, views)
            except gpucache.RefusedError as e:
                # e.g. a stored block larger than the object: that key is a miss.
                got = list(getattr(e, "results", None) or [None] * len(keys))
            except gpucache.Error as e:
                return f"load failed, reported as misses ({self._note_error(e)})"
            mismatched = 0
            with task.lock:
                if task.done:
                    return None
                for i, (n, g, src) in enumerate(zip(want, got, views)):
                    if type(g) is not int or g != n:
                        mismatched += g is not None
                        continue
                    dst = self._view(task.objects[start + i])
                    if dst is None or len(dst) != n:
                        continue
                    dst[:] = src
                    task.found[start + i] = True
            if mismatched:
                with self._lock:
                    self._stats["length_mismatch"] += mismatched
        return None

    def _store(self, task: _Task) -> Optional[str]:
        with task.lock:
            if task.done:
                return None
            sizes = [o.get_size() for o in task.objects]
        for start, end in self._groups(sizes):
            if not self._live(task):
                return "past the deadline"
            want = sizes[start:end]
            if any(n > gpucache.PAYLOAD_BYTES_MAX for n in want):
                return f"an object exceeds GPUCache's {gpucache.PAYLOAD_BYTES_MAX} bytes"
            staging = memoryview(bytearray(sum(want)))
            views, at = [], 0
            with task.lock:
                if task.done:
                    return None
                for i, n in enumerate(want):
                    src = self._view(task.objects[start + i])
                    if src is None or len(src) != n:
                        return "an L1 object is not in host memory"
                    views.append(staging[at : at + n])
                    views[-1][:] = src
                    at += n
            keys = [self.gpucache_key(k) for k in task.keys[start:end]]
            try:
                self.client.batch_put_from(keys, views)
            except gpucache.Error as e:
                return f"store failed ({self._note_error(e)})"
            with task.lock:
                for i in range(start, end):
                    task.found[i] = True
        return None

    # ---- L2AdapterInterface -----------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._notifiers[STORE].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._notifiers[LOOKUP].fileno()

    def get_load_event_fd(self) -> int:
        return self._notifiers[LOAD].fileno()

    def submit_store_task(self, keys: List[Any], objects: List[Any]) -> L2TaskId:
        return self._submit(STORE, keys, objects)

    def pop_completed_store_tasks(self) -> Dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done = dict(self._results[STORE])
            self._results[STORE].clear()
        return done

    def submit_lookup_and_lock_task(self, keys: List[Any], group_layout_descs: Any) -> L2TaskId:
        return self._submit(LOOKUP, keys, None)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Optional[Bitmap]:
        with self._lock:
            return self._results[LOOKUP].pop(task_id, None)

    def submit_unlock(self, keys: List[Any]) -> None:
        """GPUCache takes no lock at lookup: nothing to release."""
        return None

    def submit_load_task(self, keys: List[Any], objects: List[Any]) -> L2TaskId:
        return self._submit(LOAD, keys, objects)

    def query_load_result(self, task_id: L2TaskId) -> Optional[Bitmap]:
        with self._lock:
            return self._results[LOAD].pop(task_id, None)

    def report_status(self) -> dict:
        with self._lock:
            return {
                "is_healthy": not self._closing,
                "type": type(self).__name__,
                "server": self.address.hostport,
                "tenant": self.address.tenant,
                "deadline_s": self.deadline_s,
                "outstanding_tasks": len(self._outstanding),
                "last_error": self._last_error,
                **dict(self._stats),
            }

    def close(self) -> None:
        """Reports every outstanding task as failed (after which no worker touches LMCache's
        memory), stops the workers, waiting for one in a server call at most the call timeout
        and CLOSE_SLACK_S, and closes the client once none is left in a call."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            pending = list(self._outstanding.values())
            self._wake.notify_all()
        for task in pending:
            self._report(task, "the adapter closed")
        for q, n in ((self._queues[STORE], STORE_THREADS), (self._queues[LOOKUP], READ_THREADS)):
            while True:  # drop queued tasks (all reported above) so the stop marks fit
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
            for _ in range(n):
                try:
                    q.put_nowait(None)
                except queue.Full:
                    break
        until = time.monotonic() + self.address.timeout_s + CLOSE_SLACK_S
        for t in self._threads + [self._watchdog]:
            t.join(timeout=max(0.0, until - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            logger.warning("GPUCache L2 adapter closed with %s still in a server call", stuck)
        else:
            self.client.close()
        with self._lock:
            self._fds_closed = True
            for n in self._notifiers.values():
                n.close()

    def __repr__(self) -> str:
        return f"<GPUCacheL2Adapter {self.address.hostport} tenant={self.address.tenant}>"
