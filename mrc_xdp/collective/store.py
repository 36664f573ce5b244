"""A small key-value store for the rendezvous of a communicator, over TCP.

What torch.distributed's TCPStore does for a process group, for users of the collective
library without PyTorch: rank 0 serves, every rank (rank 0 included) is a client.  Keys are
strings, values bytes; ``get`` waits until the key is set (or the timeout passes), ``add``
is an atomic counter.  Under torch the communicator takes torch's store instead (any object
with ``set``, ``get`` and ``add`` of the same meaning: see ``TorchStore``).

Wire format: one JSON object per line each way, values base64.  A request is at most
``MAX_LINE`` bytes; a client that sends garbage is answered with an error line and
dropped, never crashes the server.  The server is a daemon thread: it ends with the
process, or at ``close()``.
"""
from __future__ import annotations

import base64
import json
import socket
import threading
import time

MAX_LINE = 1 << 20


class StoreError(RuntimeError):
    """The store could not be reached or answered an error; one line."""


class StoreServer:
    """Serve the store on (host, port); port 0 picks a free one (``.port``)."""

    def __init__(self, host: str = "::", port: int = 0):
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(fam, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise StoreError("store: cannot listen on [%s]:%d: %s" % (host, port, e.strerror)) from None
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self._data: dict[str, bytes] = {}
        self._cv = threading.Condition()
        self._closed = False
        self._conns: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="mrc-store", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self._sock.accept()
            except OSError:
                return
            self._conns.add(c)
            threading.Thread(target=self._serve, args=(c,), name="mrc-store-conn", daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        f = c.makefile("rb")
        try:
            while not self._closed:
                line = f.readline(MAX_LINE + 1)
                if not line:
                    return
                try:
                    req = json.loads(line) if len(line) <= MAX_LINE else None
                    if not isinstance(req, dict):
                        raise ValueError("not a request")
                    ans = self._handle(req)
                except (ValueError, KeyError, TypeError, RecursionError) as e:
                    c.sendall(json.dumps({"error": "bad request: %s" % e}).encode() + b"\n")
                    return
                c.sendall(json.dumps(ans).encode() + b"\n")
        except OSError:
            return
        finally:
            self._conns.discard(c)
            c.close()

    def _handle(self, req: dict) -> dict:
        op, key = req["op"], str(req["key"])
        with self._cv:
            if op == "set":
                self._data[key] = base64.b64decode(req["value"])
                self._cv.notify_all()
                return {"ok": True}
            if op == "add":
                n = int.from_bytes(self._data.get(key, b"\0" * 8), "little", signed=True) + int(req["n"])
                self._data[key] = n.to_bytes(8, "little", signed=True)
                self._cv.notify_all()
                return {"value": n}
            if op == "get":
                deadline = time.monotonic() + float(req.get("timeout", 60))
                while key not in self._data and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return {"timeout": True}
                    self._cv.wait(left)
                if key not in self._data:
                    return {"timeout": True}
                return {"value": base64.b64encode(self._data[key]).decode()}
        raise ValueError("unknown op %r" % op)

    def close(self) -> None:
        self._closed = True
        with self._cv:
            self._cv.notify_all()
        try:
            self._sock.close()
        except OSError:
            pass
        for c in list(self._conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class StoreClient:
    """A connection to a StoreServer.  Every call is bounded by ``timeout`` seconds."""

    def __init__(self, host: str, port: int, timeout: float = 60.0):
        self.timeout = timeout
        deadline = time.monotonic() + timeout
        last = None
        while True:                 # the server may not be listening yet: retry
            try:
                self._sock = socket.create_connection((host, port), timeout=min(5.0, timeout))
                break
            except OSError as e:
                last = e
                if time.monotonic() >= deadline:
                    raise StoreError("store [%s]:%d: %s (is rank 0 running?)"
                                     % (host, port, last.strerror or last)) from None
                time.sleep(0.1)
        self._f = self._sock.makefile("rb")
        self._lock = threading.Lock()
        self._where = "[%s]:%d" % (host, port)

    def _call(self, req: dict, wait: float) -> dict:
        with self._lock:
            self._sock.settimeout(wait + 5.0)
            try:
                self._sock.sendall(json.dumps(req).encode() + b"\n")
                line = self._f.readline(MAX_LINE + 1)
            except OSError as e:
                raise StoreError("store %s: %s" % (self._where, e)) from None
        if not line:
            raise StoreError("store %s: the server closed the connection (rank 0 gone?)" % self._where)
        ans = json.loads(line)
        if "error" in ans:
            raise StoreError("store %s: %s" % (self._where, ans["error"]))
        return ans

    def set(self, key: str, value: bytes) -> None:
        self._call({"op": "set", "key": key, "value": base64.b64encode(bytes(value)).decode()}, 0)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        t = self.timeout if timeout is None else timeout
        ans = self._call({"op": "get", "key": key, "timeout": t}, t)
        if ans.get("timeout"):
            raise StoreError("store %s: no key %r after %.0f s (a rank did not arrive)" % (self._where, key, t))
        return base64.b64decode(ans["value"])

    def add(self, key: str, n: int) -> int:
        return int(self._call({"op": "add", "key": key, "n": int(n)}, 0)["value"])

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


class TorchStore:
    """torch.distributed's Store (TCPStore, FileStore, PrefixStore) behind the same three
    calls; torch's ``get`` waits with the store's own timeout."""

    def __init__(self, store):
        self._s = store

    def set(self, key: str, value: bytes) -> None:
        self._s.set(key, bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        try:
            return bytes(self._s.get(key))
        except RuntimeError as e:          # torch raises DistStoreError (a RuntimeError) on timeout
            raise StoreError("store: %s" % str(e).splitlines()[0]) from None

    def add(self, key: str, n: int) -> int:
        return int(self._s.add(key, int(n)))

    def close(self) -> None:
        pass
