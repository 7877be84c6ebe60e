"""The ``gpucache://`` address every engine connector takes, and the client it opens.

``gpucache://HOST:PORT?tenant=NAME&key_file=PATH&key_id=ID&local=auto&timeout_s=30``

Only ``HOST:PORT`` is required. ``tenant`` defaults to ``default``; ``local`` is ``auto``
(the same-host path when the server offers it, else TCP), ``true`` (require it) or ``false``
(TCP only); ``timeout_s`` bounds every call. Any other query field, a missing port or another
scheme is a ``ValueError`` naming what is wrong, so a typo never silently falls back to a
default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union
from urllib.parse import parse_qs, urlsplit

SCHEME = "gpucache"
_FIELDS = ("tenant", "key_file", "key_id", "local", "timeout_s")
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

    @property
    def hostport(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def connect(self, client_name: str):
        """A ``gpucache.Client`` for this address."""
        import gpucache

        return gpucache.Client(
            self.hostport,
            tenant=self.tenant,
            key_file=self.key_file,
            key_id=self.key_id,
            local=self.local,
            timeout_s=self.timeout_s,
            client_name=client_name,
        )


def parse(url: str) -> Address:
    """Parses a ``gpucache://HOST:PORT?...`` address (see the module's doc)."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"a GPUCache address must be a non-empty string, not {url!r}")
    parts = urlsplit(url)
    if parts.scheme != SCHEME:
        raise ValueError(f"{url!r}: a GPUCache address starts with {SCHEME}://")
    if parts.path not in ("", "/") or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{url!r}: only {SCHEME}://HOST:PORT?FIELD=VALUE&... is understood")
    try:
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{url!r}: bad port ({e})") from None
    if not parts.hostname or port is None:
        raise ValueError(f"{url!r}: the address needs a host and a port")
    query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=False)
    unknown = sorted(set(query) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{url!r}: unknown field(s) {unknown}; known: {list(_FIELDS)}")
    one = {}
    for k, vs in query.items():
        if len(vs) != 1 or vs[0] == "":
            raise ValueError(f"{url!r}: field {k!r} needs exactly one non-empty value")
        one[k] = vs[0]
    local = _LOCAL.get(one.get("local", "auto").lower())
    if local is None:
        raise ValueError(f"{url!r}: local must be auto, true or false")
    try:
        timeout_s = float(one.get("timeout_s", "30"))
    except ValueError:
        raise ValueError(f"{url!r}: timeout_s must be a number of seconds") from None
    if not timeout_s > 0:
        raise ValueError(f"{url!r}: timeout_s must be positive")
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
