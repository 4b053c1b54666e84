"""A loopback TCP forwarder that can cut and heal every link through it.

Cut, it forwards no byte in either direction but keeps every socket open, and it accepts new
connections without ever connecting them through: what a dead switch port or a half-open
connection looks like to both ends (no reset, no error, only silence). Healed, what was held back
flows again, as TCP's retransmissions would deliver it.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable


class Forwarder:
    """Forward ``127.0.0.1:<port>`` to ``upstream`` (an address, or a function that returns it
    when a connection arrives)."""

    def __init__(self, upstream: tuple[str, int] | Callable[[], tuple[str, int]]) -> None:
        self._upstream = upstream
        self._healed = threading.Event()
        self._healed.set()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, name="forwarder-accept", daemon=True).start()

    @property
    def is_cut(self) -> bool:
        return not self._healed.is_set()

    def cut(self) -> None:
        """Stop forwarding: every byte in either direction is held back from now on."""
        self._healed.clear()

    def heal(self) -> None:
        self._healed.set()

    def close(self) -> None:
        self._closed.set()
        self._healed.set()
        self._server.close()
        with self._lock:
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def __enter__(self) -> Forwarder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _keep(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            self._keep(client)
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        self._healed.wait()  # a connection made during a cut gets nowhere until the heal
        if self._closed.is_set():
            return
        address = self._upstream() if callable(self._upstream) else self._upstream
        try:
            server = socket.create_connection(address)
        except OSError:
            client.close()
            return
        self._keep(server)
        for src, dst in ((client, server), (server, client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            self._healed.wait()  # held back while the link is cut
            if not data or self._closed.is_set():
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            try:
                dst.sendall(data)
            except OSError:
                return
