"""``EtcdStore``: the ``Store`` API over an etcd server (v3, its JSON gateway over HTTP).

What ``tdist run --rdzv-backend etcd`` uses to let the nodes of a job meet (torchrun's etcd
rendezvous): an etcd cluster the job does not own, reachable by every node. Each store is a key
prefix in etcd (``/tdist/<run id>`` for a job), so several jobs share one etcd.

How the Store API maps onto etcd:
- ``set``/``get``/``check``/``delete_key``/``num_keys``/``list_keys``: put, range and
  delete-range under the prefix;
- ``add``, ``compare_set`` and ``append``: a read, then a transaction that writes only if the
  key's modification revision is still the one read (retried when another client came between);
- ``wait`` (and ``get`` of a missing key): a watch on the prefix from the revision at which keys were last found missing, so a
  waiter sleeps in etcd until something changes and never polls; the store's timeout bounds it.

Values are bytes (base64 in the JSON, as the gateway wants them). Only the standard library is
used (``http.client``). Queues (``queue_push``/``queue_pop``) are not offered.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from .._core.errors import DistNetworkError, DistStoreError, StoreTimeoutError, StoreValueError
from ._api import DEFAULT_TIMEOUT, Store, as_bytes, check_key, key_list

__all__ = ["EtcdStore", "EtcdStoreTimeoutError"]

log = logging.getLogger(__name__)

_MAX_TXN_OPS = 128


class EtcdStoreTimeoutError(StoreTimeoutError, LookupError):
    """``get``/``wait`` of an ``EtcdStore`` timed out: tdist's ``StoreTimeoutError`` (a
    ``TimeoutError``) that is also the ``LookupError`` torch's ``EtcdStore`` documents."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _prefix_end(prefix: bytes) -> bytes:
    """The end of etcd's range of every key starting with ``prefix`` (exclusive)."""
    data = bytearray(prefix)
    while data:
        if data[-1] < 0xFF:
            data[-1] += 1
            return bytes(data)
        data.pop()
    return b"\0"


class EtcdStore(Store):
    """A store in etcd, under ``prefix``.

    Args:
        host, port: an etcd server's client address (its ``--listen-client-urls``).
        prefix: where this store's keys live in etcd.
        timeout: of blocking calls (``get``, ``wait``) and of each request.

    Raises:
        DistNetworkError: etcd cannot be reached (checked at once).
    """

    def __init__(self, host: str, port: int = 2379, prefix: str = "/tdist", timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        self.host, self.port = host, int(port)
        self._prefix = prefix.rstrip("/").encode() + b"/"
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self._last: dict[str, dict[str, Any]] = {}  # what this client last wrote, by key (_update)
        self._lease: str | None = None  # (keep_alive)
        self._stop_renewing: threading.Event | None = None
        self._call("/v3/kv/range", {"key": _b64(self._prefix), "count_only": True})

    def __repr__(self) -> str:
        return f"EtcdStore({self.host}:{self.port}, prefix={self._prefix.decode()!r})"

    # -- requests --------------------------------------------------------------------------------
    def _request_timeout(self) -> float:
        return max(1.0, min(30.0, self._timeout.total_seconds()))

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        payload = json.dumps(body).encode()
        with self._lock:
            for attempt in (0, 1):  # (one retry on a connection etcd closed while idle)
                if self._conn is None:
                    self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self._request_timeout())
                try:
                    self._conn.request("POST", path, payload, {"Content-Type": "application/json"})
                    resp = self._conn.getresponse()
                    data = resp.read()
                except (OSError, http.client.HTTPException) as exc:
                    self._conn.close()
                    self._conn = None
                    # (an idle connection etcd closed: the request was not applied; a reset while
                    # reading the reply may come after it was, so that is not retried)
                    if attempt == 0 and isinstance(exc, (http.client.RemoteDisconnected, BrokenPipeError)):
                        continue
                    raise DistNetworkError(f"etcd at {self.host}:{self.port} cannot be reached: {exc}") from exc
                break
        if resp.status != 200:
            raise DistStoreError(
                f"etcd at {self.host}:{self.port} refused {path}: HTTP {resp.status} {data[:200].decode(errors='replace')}"
            )
        try:
            parsed: dict[str, Any] = json.loads(data)
        except ValueError as exc:
            raise DistStoreError(f"etcd at {self.host}:{self.port} answered {path} with something that is not JSON") from exc
        return parsed

    def _key(self, key: str) -> bytes:
        return self._prefix + check_key(key).encode()

    def _range(self, key: str) -> tuple[dict[str, Any] | None, int]:
        """The key's record (None if missing) and the store's revision."""
        out = self._call("/v3/kv/range", {"key": _b64(self._key(key))})
        kvs = out.get("kvs") or []
        return (kvs[0] if kvs else None), int(out.get("header", {}).get("revision", 0))

    def _txn_put(self, key: str, mod_revision: int | None, value: bytes) -> tuple[int, dict[str, Any] | None]:
        """Put ``value`` if the key's modification revision is ``mod_revision`` (None: the key
        is missing). Returns the key's new modification revision (0 if it was not put) and,
        when it was not, the key's record (None if missing), read in the same transaction."""
        k = _b64(self._key(key))
        compare = (
            {"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            if mod_revision is None
            else {"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}
        )
        out = self._call(
            "/v3/kv/txn",
            {
                "compare": [compare],
                "success": [{"request_put": self._put_body(k, value)}],
                "failure": [{"request_range": {"key": k}}],
            },
        )
        if out.get("succeeded", False):
            return int(out.get("header", {}).get("revision", 0)), None
        responses = out.get("responses") or [{}]
        kvs = (responses[0].get("response_range") or {}).get("kvs") or []
        return 0, (kvs[0] if kvs else None)

    def _update(self, key: str, change: Any) -> bytes:
        """Set the key to ``change(current or None)`` atomically (``change`` returning None:
        leave it); returns the value after the call.

        One request when the guess holds: the key is first taken to be what this client last
        wrote there (or missing); a transaction that finds otherwise returns what is there in
        the same answer, and the change is tried again on that."""
        record = self._last.get(key)
        guessed = True
        while True:
            current = _unb64(record.get("value")) if record is not None else None
            new = change(current)
            if new is None:
                if guessed:  # (a guess may be stale: decide on what is really there)
                    record, _ = self._range(key)
                    guessed = False
                    continue
                return current if current is not None else b""
            revision, record = self._txn_put(key, int(record["mod_revision"]) if record is not None else None, new)
            if revision:
                if len(self._last) >= 1024:
                    self._last.clear()
                self._last[key] = {"value": _b64(new), "mod_revision": str(revision)}
                return new  # type: ignore[no-any-return]
            guessed = False

    # -- the Store API ------------------------------------------------------------------------------
    def _put_body(self, key_b64: str, value: bytes) -> dict[str, Any]:
        body = {"key": key_b64, "value": _b64(value)}
        if self._lease is not None:
            body["lease"] = self._lease
        return body

    def set(self, key: str, value: str | bytes) -> None:
        self._call("/v3/kv/put", self._put_body(_b64(self._key(key)), as_bytes(value)))

    def keep_alive(self, ttl: float = 30.0) -> None:
        """From now on, what this store writes lives only while it does: the keys are put under
        an etcd lease of ``ttl`` seconds, renewed by a thread until ``close()``, so the keys of a
        client that dies (a crashed launcher) leave etcd ``ttl`` seconds later."""
        if self._lease is not None:
            return
        out = self._call("/v3/lease/grant", {"TTL": max(2, int(ttl))})
        self._lease = str(out["ID"])
        stop = self._stop_renewing = threading.Event()

        def renew() -> None:
            while not stop.wait(max(1.0, ttl / 3)):
                try:
                    answer = self._call("/v3/lease/keepalive", {"ID": self._lease})
                    if not int((answer.get("result") or {}).get("TTL", 0)):
                        log.error("%r: etcd lease %s expired; this store's keys are gone", self, self._lease)
                        return
                except DistStoreError as exc:  # (etcd busy or electing a leader: try again)
                    log.warning("%r: could not renew etcd lease %s: %s", self, self._lease, exc)
                except DistNetworkError as exc:
                    log.warning("%r: could not renew etcd lease %s: %s", self, self._lease, exc)

        threading.Thread(target=renew, name="tdist-etcd-lease", daemon=True).start()

    def get(self, key: str) -> bytes:
        record, _ = self._range(key)
        if record is None:
            self.wait([key])
            record, _ = self._range(key)
            if record is None:  # (deleted again meanwhile)
                raise EtcdStoreTimeoutError(f"{self!r}: key {key!r} was deleted while get() waited for it")
        return _unb64(record.get("value"))

    def add(self, key: str, amount: int) -> int:
        if int(amount) == 0:  # (a read: no write, no new revision, once the key exists)
            record, _ = self._range(key)
            if record is not None:
                try:
                    return int(_unb64(record.get("value")))
                except ValueError:
                    pass  # (the change below says what the key holds)

        def change(current: bytes | None) -> bytes:
            try:
                base = int(current) if current else 0
            except ValueError:
                raise StoreValueError(f"{self!r}: add() on key {key!r}, which holds {(current or b'')[:40]!r}, not an integer") from None
            return str(base + int(amount)).encode()

        return int(self._update(key, change))

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        expected, desired = as_bytes(expected_value), as_bytes(desired_value)
        seen: list[bytes | None] = []

        def change(current: bytes | None) -> bytes | None:
            seen.append(current)
            return desired if (current if current is not None else b"") == expected else None

        result = self._update(key, change)
        if seen[-1] is None and expected:  # a missing key, expected non-empty: torch's answer
            return expected
        return result

    def append(self, key: str, value: str | bytes) -> None:
        data = as_bytes(value)
        self._update(key, lambda current: (current or b"") + data)

    def check(self, keys: Sequence[str]) -> bool:
        keys = key_list(keys, "check")
        return not self._missing(keys)[0]

    def _missing(self, keys: Sequence[str]) -> tuple[list[str], int]:
        """The keys not set, and the revision they were read at (one request for all)."""
        keys = [check_key(k) for k in keys]
        if len(keys) == 1:
            record, revision = self._range(keys[0])
            return ([] if record is not None else list(keys)), revision
        missing: list[str] = []
        revision = 0
        for start in range(0, len(keys), _MAX_TXN_OPS):  # (etcd's default --max-txn-ops)
            chunk = keys[start : start + _MAX_TXN_OPS]
            ranges = [{"request_range": {"key": _b64(self._key(k)), "count_only": True}} for k in chunk]
            out = self._call("/v3/kv/txn", {"success": ranges})
            counts = [int((r.get("response_range") or {}).get("count", 0)) for r in out.get("responses") or []]
            missing += [k for k, n in zip(chunk, counts + [0] * (len(chunk) - len(counts)), strict=True) if not n]
            # (the first read's revision: a watch from there misses no change since)
            revision = revision or int(out.get("header", {}).get("revision", 0))
        return missing, revision

    def delete_key(self, key: str) -> bool:
        out = self._call("/v3/kv/deleterange", {"key": _b64(self._key(key))})
        return int(out.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        out = self._call("/v3/kv/range", {"key": _b64(self._prefix), "range_end": _b64(_prefix_end(self._prefix)), "count_only": True})
        return int(out.get("count", 0))

    def list_keys(self) -> list[str]:
        out = self._call("/v3/kv/range", {"key": _b64(self._prefix), "range_end": _b64(_prefix_end(self._prefix)), "keys_only": True})
        n = len(self._prefix)
        return [_unb64(kv["key"])[n:].decode(errors="replace") for kv in out.get("kvs") or []]

    def queue_push(self, key: str, value: str | bytes) -> None:
        raise DistStoreError("EtcdStore has no queues (queue_push)")

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        raise DistStoreError("EtcdStore has no queues (queue_pop)")

    def queue_len(self, key: str) -> int:
        raise DistStoreError("EtcdStore has no queues (queue_len)")

    def delete_all(self) -> int:
        """Delete every key of this store (its prefix) from etcd; returns how many there were."""
        out = self._call("/v3/kv/deleterange", {"key": _b64(self._prefix), "range_end": _b64(_prefix_end(self._prefix))})
        return int(out.get("deleted", 0))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        keys = key_list(keys, "wait")
        seconds = self._timeout_seconds(timeout)
        deadline = time.monotonic() + seconds
        keys = [check_key(k) for k in keys]
        while True:
            missing, revision = self._missing(keys)
            if not missing:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EtcdStoreTimeoutError(
                    f"{self!r}: wait() timed out after {seconds:g} s; keys still missing: {missing}"
                )
            self._watch_once(revision + 1, remaining)

    def _watch_once(self, start_revision: int, timeout: float) -> None:
        """Return when anything under the prefix changes at or after ``start_revision``, or
        after ``timeout`` seconds."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        body = {
            "create_request": {
                "key": _b64(self._prefix),
                "range_end": _b64(_prefix_end(self._prefix)),
                "start_revision": str(start_revision),
            }
        }
        try:
            conn.request("POST", "/v3/watch", json.dumps(body).encode(), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            while True:
                line = resp.readline()
                if not line:
                    return  # (the stream ended: look again)
                try:
                    result = json.loads(line).get("result", {})
                except ValueError:
                    continue
                if result.get("events") or result.get("canceled") or result.get("compact_revision"):
                    return
        except TimeoutError:
            return
        except (OSError, http.client.HTTPException) as exc:
            raise DistNetworkError(f"etcd at {self.host}:{self.port}: watch failed: {exc}") from exc
        finally:
            conn.close()

    def clone(self) -> EtcdStore:
        return EtcdStore(self.host, self.port, self._prefix.decode().rstrip("/"), self._timeout)

    def close(self) -> None:
        """Close the connection and stop renewing the lease (its keys expire ``ttl`` later:
        others may still have to read them)."""
        if self._stop_renewing is not None:
            self._stop_renewing.set()
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
