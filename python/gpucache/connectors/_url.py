"""The ``gpucache://`` address every engine connector takes, and the client it opens.

``gpucache://HOST:PORT?tenant=NAME&key_file=PATH&key_id=ID&local=auto&timeout_s=30``

Only ``HOST:PORT`` is required. ``tenant`` defaults to ``default``; ``local`` is ``auto``
(the same-host path when the server offers it, else TCP), ``true`` (require it) or ``false``
(TCP only); ``timeout_s`` bounds every call. Any other query field, a missing port or another
scheme is a ``ValueError`` naming what is wrong, so a typo never silently falls back to a
default.

A cluster is named by its etcd members and its name instead of one server:

``gpucache+etcd://HOST:PORT[,HOST:PORT...]/CLUSTER?tenant=NAME&key_file=PATH&key_id=ID&timeout_s=30``

and the connector's client routes every key to its node (``gpucache.Client.cluster``); ``local``
does not apply there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union
from urllib.parse import parse_qs, urlsplit

SCHEME = "gpucache"
CLUSTER_SCHEME = "gpucache+etcd"
_FIELDS = ("tenant", "key_file", "key_id", "local", "timeout_s")
_CLUSTER_FIELDS = ("tenant", "key_file", "key_id", "timeout_s")
_LOCAL = {"auto": "auto", "true": True, "1": True, "false": False, "0": False}


@dataclass(frozen=True)
class Address:
    """A parsed ``gpucache://`` address."""

    host: str
    port: int
    tenant: str = "default"
    key_file: Optional[str] = None
    key_id: Optional[str] = None
    local: Union[str, bool] = "auto"
    timeout_s: float = 30.0
    # A cluster: its etcd members (HOST:PORT) and name; host and port are then the first
    # member's.
    etcd: Tuple[str, ...] = ()
    cluster: Optional[str] = None

    @property
    def hostport(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def connect(self, client_name: str):
        """A ``gpucache.Client`` for this address (a cluster's client for a cluster)."""
        import gpucache

        if self.etcd:
            return gpucache.Client.cluster(
                [f"http://{member}" for member in self.etcd],
                name=self.cluster,
                tenant=self.tenant,
                key_file=self.key_file,
                key_id=self.key_id,
                timeout_s=self.timeout_s,
                client_name=client_name,
            )
        return gpucache.Client(
            self.hostport,
            tenant=self.tenant,
            key_file=self.key_file,
            key_id=self.key_id,
            local=self.local,
            timeout_s=self.timeout_s,
            client_name=client_name,
        )


def _fields(url: str, query: str, known) -> dict:
    """The query's fields, each given once with a value; an unknown one is an error."""
    fields = parse_qs(query, keep_blank_values=True, strict_parsing=False)
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ValueError(f"{url!r}: unknown field(s) {unknown}; known: {list(known)}")
    one = {}
    for k, vs in fields.items():
        if len(vs) != 1 or vs[0] == "":
            raise ValueError(f"{url!r}: field {k!r} needs exactly one non-empty value")
        one[k] = vs[0]
    return one


def _timeout(url: str, one: dict) -> float:
    try:
        timeout_s = float(one.get("timeout_s", "30"))
    except ValueError:
        raise ValueError(f"{url!r}: timeout_s must be a number of seconds") from None
    if not timeout_s > 0:
        raise ValueError(f"{url!r}: timeout_s must be positive")
    return timeout_s


def _parse_cluster(url: str) -> Address:
    rest = url[len(CLUSTER_SCHEME) + 3 :]
    members, _, rest = rest.partition("/")
    name, _, query = rest.partition("?")
    if not name or "/" in name or "#" in name:
        raise ValueError(f"{url!r}: a cluster address ends in /CLUSTER (its name) before any ?")
    etcd = tuple(m for m in members.split(","))
    for m in etcd:
        host, sep, port = m.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{url!r}: etcd member {m!r} is not HOST:PORT")
    one = _fields(url, query, _CLUSTER_FIELDS)
    first_host, _, first_port = etcd[0].rpartition(":")
    return Address(
        host=first_host.strip("[]"),
        port=int(first_port),
        tenant=one.get("tenant", "default"),
        key_file=one.get("key_file"),
        key_id=one.get("key_id"),
        local=False,
        timeout_s=_timeout(url, one),
        etcd=etcd,
        cluster=name,
    )


def parse(url: str) -> Address:
    """Parses a ``gpucache://HOST:PORT?...`` or ``gpucache+etcd://...`` address (see the
    module's doc)."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"a GPUCache address must be a non-empty string, not {url!r}")
    if url.startswith(CLUSTER_SCHEME + "://"):
        return _parse_cluster(url)
    parts = urlsplit(url)
    if parts.scheme != SCHEME:
        raise ValueError(
            f"{url!r}: a GPUCache address starts with {SCHEME}:// (or {CLUSTER_SCHEME}://)"
        )
    if parts.path not in ("", "/") or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{url!r}: only {SCHEME}://HOST:PORT?FIELD=VALUE&... is understood")
    try:
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{url!r}: bad port ({e})") from None
    if not parts.hostname or port is None:
        raise ValueError(f"{url!r}: the address needs a host and a port")
    one = _fields(url, parts.query, _FIELDS)
    local = _LOCAL.get(one.get("local", "auto").lower())
    if local is None:
        raise ValueError(f"{url!r}: local must be auto, true or false")
    timeout_s = _timeout(url, one)
    return Address(
        host=parts.hostname,
        port=port,
        tenant=one.get("tenant", "default"),
        key_file=one.get("key_file"),
        key_id=one.get("key_id"),
        local=local,
        timeout_s=timeout_s,
    )


def kv_dtype_name(dtype) -> str:
    """The ``Identity`` dtype name of a torch dtype (``torch.bfloat16`` -> ``bfloat16``);
    ``Identity`` itself refuses a dtype it does not know."""
    name = str(dtype)
    return name[len("torch.") :] if name.startswith("torch.") else name
