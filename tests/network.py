"""A network the tests control: TCP forwarders to the database, and worker "hosts" in
network namespaces whose link to this machine can be cut.

A cut sets the host side of the namespace's veth pair down: packets are dropped
without a reset, so a worker inside sees a silent network, the dangerous case,
where a read can wait forever. Needs root and ``ip`` (Linux).
"""

from __future__ import annotations

import itertools
import os
import select
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_numbers = itertools.count(1)


class Forwarder:
    """Forward TCP connections from ``listen_host`` to the database at ``target``.

    ``refuse`` closes every forwarded connection and refuses new ones (a server that
    is down); ``accept`` serves again. Forwarded sockets use TCP keepalives of a few
    seconds, as a server with ``tcp_keepalives_idle`` set would, so a session whose
    client vanished behind a cut is ended and its locks released.
    """

    def __init__(self, target: tuple[str, int], listen_host: str = "127.0.0.1", keepalive: int = 3) -> None:
        self.target = target
        self.listen_host = listen_host
        self.keepalive = keepalive
        self.port = 0
        self._listener: socket.socket | None = None
        self._pairs: set[tuple[socket.socket, socket.socket]] = set()
        self._lock = threading.Lock()
        self._stopped = False
        self.accept()

    def accept(self) -> None:
        """Listen (again, on the same port once known) and forward new connections."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.listen_host, self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept_loop, args=(listener,), daemon=True).start()

    def refuse(self) -> None:
        """Close every forwarded connection and the listener: connects are refused."""
        listener, self._listener = self._listener, None
        if listener is not None:
            _close(listener)
        with self._lock:
            pairs, self._pairs = self._pairs, set()
        for client, upstream in pairs:
            _close(client)
            _close(upstream)

    def close(self) -> None:
        self._stopped = True
        self.refuse()

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # the listener was closed
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, self.keepalive)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, (self.keepalive + 3) * 1000)
            pair = (client, upstream)
            with self._lock:
                self._pairs.add(pair)
            threading.Thread(target=self._pump, args=(pair,), daemon=True).start()

    def _pump(self, pair: tuple[socket.socket, socket.socket]) -> None:
        client, upstream = pair
        other = {client: upstream, upstream: client}
        try:
            while True:
                ready, _, _ = select.select([client, upstream], [], [], 1.0)
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    other[sock].sendall(data)
        except (OSError, ValueError):
            return
        finally:
            with self._lock:
                self._pairs.discard(pair)
            _close(client)
            _close(upstream)


class Host:
    """A network namespace joined to this machine by a veth pair: a worker host of its own.

    ``prefix`` runs a command inside it; ``env`` points a worker at the database
    through a forwarder listening on this machine's end of the pair.
    """

    def __init__(self, database: tuple[str, int]) -> None:
        number = next(_numbers)
        tag = f"{os.getpid() % 1000}{number}"
        self.namespace = f"dbq-{tag}"
        self.outside = f"dbq{tag}o"[:15]
        self.inside = f"dbq{tag}i"[:15]
        octet = (os.getpid() * 7 + number) % 250 + 1
        self.outside_ip = f"10.213.{octet}.1"
        self.inside_ip = f"10.213.{octet}.2"
        self.forwarder: Forwarder | None = None
        self.database = database

    def start(self) -> Host:
        ns, out, inside = self.namespace, self.outside, self.inside
        _ip("netns", "add", ns)
        _ip("link", "add", out, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", ns)
        _ip("addr", "add", f"{self.outside_ip}/30", "dev", out)
        _ip("link", "set", out, "up")
        _ip("-n", ns, "addr", "add", f"{self.inside_ip}/30", "dev", inside)
        _ip("-n", ns, "link", "set", inside, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self.forwarder = Forwarder(self.database, listen_host=self.outside_ip)
        return self

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]

    def env(self, vendor: str) -> dict[str, str]:
        assert self.forwarder is not None
        if vendor == "postgresql":
            return {"PGHOST": self.outside_ip, "PGPORT": str(self.forwarder.port)}
        return {"MYSQL_HOST": self.outside_ip, "MYSQL_PORT": str(self.forwarder.port)}

    def cut(self) -> None:
        """Drop every packet between the host and this machine, without a reset."""
        _ip("link", "set", self.outside, "down")

    def heal(self) -> None:
        _ip("link", "set", self.outside, "up")

    def stop(self) -> None:
        if self.forwarder is not None:
            self.forwarder.close()
        subprocess.run(["ip", "netns", "del", self.namespace], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", self.outside], check=False, capture_output=True)


def namespaces_usable() -> tuple[bool, str]:
    """Whether this process may create network namespaces (root and ``ip``), and why not."""
    if shutil.which("ip") is None:
        return False, "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return False, "creating network namespaces needs root"
    probe = f"dbq-probe-{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return False, f"ip netns add failed: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


@contextmanager
def hosts(database: tuple[str, int], count: int) -> Iterator[list[Host]]:
    started: list[Host] = []
    try:
        for _ in range(count):
            started.append(Host(database).start())
        yield started
    finally:
        for host in started:
            host.stop()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
