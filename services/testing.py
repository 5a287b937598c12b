"""The device endpoint without Ray, for tests and fuzz runs: `InProcessBackend`, a test double of the Verifier
deployment (a `ciar.engine.verifier.CloudVerifier` in this process, its session tokens issued and checked as the
deployment does), and `loopback_endpoint`, which serves a `DeviceEndpoint` with uvicorn on a free port of 127.0.0.1.

    with loopback_endpoint(DeviceEndpoint(InProcessBackend(verifier), [key_digest(KEY)])) as url:
        conn = DeviceConnection(url, KEY, vocab_size=V)

The Serve application's own route (services.app) is tested against the real deployments in tests/services/.
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from ciar.engine.service import VerifierService

ROUTE = "/v1/device/sessions"


class InProcessBackend(VerifierService):
    """Test double of the Verifier deployment's handle: the deployment's own calls (`VerifierService`) on a
    CloudVerifier in this process, awaited in the event loop's thread (the endpoint's). Counts its calls."""

    def __init__(self, verifier, secret: str = "test-secret"):
        super().__init__(verifier, secret)
        self.calls = 0
        # the next `lose` VERIFYs after `lose_after` more find their session gone (closed just before: a lost
        # replica, and the one it was resumed on lost in turn)
        self.lose = self.lose_after = 0

    async def open(self, request, *, session_id, device_id):
        self.calls += 1
        return await super().open(request, session_id=session_id, device_id=device_id)

    async def verify(self, request, *, session_id, device_id, token):
        self.calls += 1
        if self.lose > 0 and self.lose_after > 0:
            self.lose_after -= 1
        elif self.lose > 0:
            self.lose -= 1
            await self.close(session_id=session_id, device_id=device_id, token=token)
        return await super().verify(request, session_id=session_id, device_id=device_id, token=token)

    async def resume(self, request, history, injected, *, session_id, device_id, token):
        self.calls += 1
        return await super().resume(request, history, injected, session_id=session_id, device_id=device_id,
                                    token=token)


@contextmanager
def loopback_endpoint(endpoint, timeout_s: float = 30.0, sndbuf: int | None = None,
                      close_timeout_s: float | None = None) -> Iterator[str]:
    """Serve `endpoint` (a services.device_endpoint.DeviceEndpoint) at ws://127.0.0.1:PORT/v1/device/sessions in a
    background thread; yields the URL without the route (what DeviceConnection takes) and stops the server after.
    `sndbuf`: the server sockets' send buffer in bytes (small: a reader that does not read blocks the server's sends
    after a few hundred kB instead of the kernel's megabytes; the slow-reader tests). `close_timeout_s`: how long
    each step of the server's closing handshake waits for the peer (websockets' `close_timeout`, 10 s by default,
    which uvicorn does not set: a close a peer never answers ends the TCP connection after about three of them)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import WebSocketRoute

    ws: object = "websockets"
    if close_timeout_s is not None:
        from uvicorn.protocols.websockets.websockets_impl import WebSocketProtocol

        class BoundedClose(WebSocketProtocol):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.close_timeout = close_timeout_s

        ws = BoundedClose
    app = Starlette(routes=[WebSocketRoute(ROUTE, endpoint.serve)])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", ws=ws))
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


class CuttingProxy:
    """A WebSocket relay between devices and an endpoint that cuts the connection at one frame (fault injection for
    the retry-semantics tests: a reply lost on a real socket, deterministically).

        with loopback_endpoint(endpoint) as url, CuttingProxy(url, [("down", wire.OPEN_REPLY, 1, "drop")]) as proxy:
            conn = DeviceConnection(proxy.url, KEY, vocab_size=V)

    A rule is (direction "up" | "down", frame type, n, mode): at the n-th frame of that type in that direction
    (counted over all connections), "deliver" relays it and then cuts (relaying nothing after it: an answer to it is
    lost), "drop" cuts without relaying it. A cut aborts
    both sockets (no closing handshake: a tunnel, a lost radio), so the endpoint sees the device go away with
    whatever it has in flight. Each rule fires once; `fired` lists the rules that did."""

    def __init__(self, upstream: str, rules=()):
        self.upstream = upstream.rstrip("/") + ROUTE
        self.rules = [tuple(r) for r in rules]
        self.fired: list[tuple] = []
        self.frames: list[tuple[str, int]] = []  # (direction, type) of every frame seen
        self._counts: dict[tuple[str, int], int] = {}
        self.url = ""

    def _cut_here(self, direction: str, data: bytes) -> str | None:
        from ciar_device import wire

        try:
            ftype = wire.decode_header(data)[1]
        except Exception:  # noqa: BLE001 - not a frame: relayed as it is
            return None
        self.frames.append((direction, ftype))
        key = (direction, ftype)
        self._counts[key] = self._counts.get(key, 0) + 1
        for rule in self.rules:
            if rule not in self.fired and rule[:2] == key and rule[2] == self._counts[key]:
                self.fired.append(rule)
                return rule[3]
        return None

    async def _relay(self, device) -> None:
        import asyncio

        from websockets.asyncio.client import connect

        async with connect(self.upstream, max_size=None, compression=None, ping_interval=None) as server:
            cutting = asyncio.Event()  # from the cut's frame on, nothing more is relayed either way

            def cut():
                for ws in (device, server):
                    ws.transport.abort()

            async def pump(src, dst, direction):
                async for data in src:
                    if cutting.is_set():
                        return
                    mode = self._cut_here(direction, data) if isinstance(data, bytes) else None
                    if mode is not None:
                        cutting.set()
                    if mode == "deliver":
                        await dst.send(data)
                        await asyncio.sleep(0.05)  # let it be read before the cut (its answer is not relayed)
                    if mode is not None:
                        cut()
                        return
                    await dst.send(data)

            tasks = [asyncio.ensure_future(pump(device, server, "up")),
                     asyncio.ensure_future(pump(server, device, "down"))]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in tasks:
                t.cancel()

    def __enter__(self) -> "CuttingProxy":
        import asyncio

        from websockets.asyncio.server import serve

        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def main():
            async def handler(device):
                try:
                    await self._relay(device)
                except Exception:  # noqa: BLE001 - a cut socket ends its relay
                    pass

            async with serve(handler, "127.0.0.1", 0, max_size=None, compression=None, ping_interval=None) as srv:
                self.url = f"ws://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
                self._stop = asyncio.Event()
                ready.set()
                await self._stop.wait()

        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(main(),), daemon=True,
                                        name="cutting-proxy")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the cutting proxy did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)
