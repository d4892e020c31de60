"""Downloading reference audio from an http(s) URL, within limits: a size and time limit, at most a few
redirects, and (for the server) only hosts it allows and no private, loopback or link-local address unless
allowed. The address checked is the address connected to (no second DNS lookup a server could be tricked
with), at every redirect.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urljoin, urlparse

MAX_REDIRECTS = 3


class FetchError(ValueError):
    """A URL that was refused or could not be downloaded."""


@dataclass(frozen=True)
class FetchPolicy:
    max_bytes: int = 50 * 2**20
    timeout_s: float = 30.0
    hosts: tuple[str, ...] = ()  # if given, only these hosts (and their private addresses too)
    allow_private: bool = True  # private, loopback, link-local... addresses (the server says False)


def fetch(url: str, policy: FetchPolicy = FetchPolicy()) -> bytes:
    """The body of `url` (http or https), following at most MAX_REDIRECTS redirects, each checked."""
    deadline = time.monotonic() + policy.timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        status, location, body = _get(url, policy, deadline)
        if status in (301, 302, 303, 307, 308) and location:
            url = urljoin(url, location)
            continue
        if status != 200:
            raise FetchError(f"could not download {_short(url)}: HTTP {status}")
        return body
    raise FetchError(f"{_short(url)}: more than {MAX_REDIRECTS} redirects")


def _get(url: str, policy: FetchPolicy, deadline: float) -> tuple[int, str | None, bytes]:
    parts = urlparse(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError(f"not an http(s) URL: {_short(url)}")
    host = parts.hostname.lower()
    if policy.hosts and host not in policy.hosts:
        raise FetchError(f"host {host!r} is not among the hosts this server downloads from")
    address = _vetted_address(host, parts.port or (443 if parts.scheme == "https" else 80),
                              policy.allow_private or bool(policy.hosts))
    conn = _Connection(parts.scheme, host, parts.port, address, max(deadline - time.monotonic(), 0.1))
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers={"User-Agent": "q3tts", "Accept": "*/*"})
        response = conn.getresponse()
        if response.status != 200:
            return response.status, response.getheader("Location"), b""
        length = response.getheader("Content-Length")
        if length and length.isdigit() and int(length) > policy.max_bytes:
            raise FetchError(f"{_short(url)} is {int(length)} bytes; the limit is {policy.max_bytes}")
        return 200, None, _read_limited(response, url, policy.max_bytes, deadline)
    except (OSError, http.client.HTTPException) as e:
        raise FetchError(f"could not download {_short(url)}: {e}") from e
    finally:
        conn.close()


def _vetted_address(host: str, port: int, allow_private: bool) -> tuple[str, int]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise FetchError(f"cannot resolve {host!r}: {e}") from e
    for *_, sockaddr in infos:
        ip = ipaddress.ip_address(sockaddr[0])
        if allow_private or ip.is_global:
            return sockaddr[0], port
    raise FetchError(f"{host!r} resolves only to private, loopback or link-local addresses, which this server "
                     f"does not download from")


class _Connection(http.client.HTTPSConnection):
    """An HTTP(S) connection to a vetted address, speaking to (and, with TLS, verifying) the original host."""

    def __init__(self, scheme: str, host: str, port: int | None, address: tuple[str, int], timeout: float):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self.scheme, self.address = scheme, address

    def connect(self) -> None:
        self.sock = socket.create_connection(self.address, self.timeout)
        if self.scheme == "https":
            self.sock = self._context.wrap_socket(self.sock, server_hostname=self.host)


def _read_limited(response: http.client.HTTPResponse, url: str, max_bytes: int, deadline: float) -> bytes:
    parts, total = [], 0
    while chunk := response.read1(65536):  # what has arrived: a trickled body still meets the deadline
        total += len(chunk)
        if total > max_bytes:
            raise FetchError(f"{_short(url)} is over {max_bytes} bytes; the limit is {max_bytes}")
        if time.monotonic() > deadline:
            raise FetchError(f"{_short(url)}: the download took too long")
        parts.append(chunk)
    return b"".join(parts)


def _short(url: str, limit: int = 120) -> str:
    return url if len(url) <= limit else url[:limit] + "..."
