"""The device endpoint without Ray, for tests and fuzz runs: `InProcessBackend`, a test double of the Verifier
deployment (a `ciar.collab.verifier.CloudVerifier` in this process, its session tokens issued and checked as the
deployment does), and `loopback_endpoint`, which serves a `DeviceEndpoint` with uvicorn on a free port of 127.0.0.1.

    with loopback_endpoint(DeviceEndpoint(InProcessBackend(verifier), [key_digest(KEY)])) as url:
        conn = DeviceConnection(url, KEY, vocab_size=V)

The Serve application's own route (services.app) is tested against the real deployments in tests/services/.
"""

from __future__ import annotations

import hmac
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from services.device_endpoint import session_token

ROUTE = "/v1/device/sessions"


class InProcessBackend:
    """Test double of the Verifier deployment's handle: one CloudVerifier, called in the event loop's thread.
    Counts its calls; refuses a token that does not belong to (session, device) as the deployment does."""

    def __init__(self, verifier, secret: str = "test-secret"):
        self.v = verifier
        self.secret = secret
        self.calls = 0

    def _check(self, session_id: str, device_id: str, token: str) -> None:
        if not hmac.compare_digest(session_token(self.secret, session_id, device_id), token or ""):
            raise PermissionError(f"session {session_id!r} belongs to another device")

    async def open(self, request, *, session_id, device_id):
        self.calls += 1
        return self.v.open_batch([request])[0], session_token(self.secret, session_id, device_id)

    async def verify(self, request, *, session_id, device_id, token):
        self._check(session_id, device_id, token)
        self.calls += 1
        return self.v.verify_batch([request])[0]

    async def resume(self, request, history, injected, *, session_id, device_id, token):
        self._check(session_id, device_id, token)
        self.calls += 1
        return self.v.resume_batch([request], [history], injected=[injected])[0]

    async def close(self, *, session_id, device_id, token):
        self._check(session_id, device_id, token)
        self.v.close(session_id)

    async def cost_hint(self):
        return self.v.cost_hint()


@contextmanager
def loopback_endpoint(endpoint, timeout_s: float = 30.0, sndbuf: int | None = None) -> Iterator[str]:
    """Serve `endpoint` (a services.device_endpoint.DeviceEndpoint) at ws://127.0.0.1:PORT/v1/device/sessions in a
    background thread; yields the URL without the route (what DeviceConnection takes) and stops the server after.
    `sndbuf`: the server sockets' send buffer in bytes (small: a reader that does not read blocks the server's sends
    after a few hundred kB instead of the kernel's megabytes; the slow-reader tests)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import WebSocketRoute

    app = Starlette(routes=[WebSocketRoute(ROUTE, endpoint.serve)])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", ws="websockets"))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)  # accepted sockets inherit it
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="loopback-endpoint")
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the loopback device endpoint did not start")
        time.sleep(0.02)
    try:
        yield f"ws://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
