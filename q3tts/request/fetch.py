"""Downloading reference audio from an http(s) URL, within limits: a size and time limit, at most
MAX_REDIRECTS redirects, and (for the server) only hosts it allows and no private, loopback or link-local address
unless allowed. The address checked is the address connected to (no second DNS lookup a server could be tricked
with), at every redirect. Without those restrictions (the Python API's default) the download goes through urllib,
as the official API's does: the proxies the environment names (http_proxy, https_proxy, no_proxy) are used.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urljoin, urlparse

MAX_REDIRECTS = 10  # (urllib's, which the official API follows)
HEADERS = {"User-Agent": "q3tts", "Accept": "*/*"}


class FetchError(ValueError):
    """A URL that was refused or could not be downloaded."""


@dataclass(frozen=True)
class FetchPolicy:
    max_bytes: int = 50 * 2**20
    timeout_s: float = 30.0
    hosts: tuple[str, ...] = ()  # if given, only these hosts (and their private addresses too)
    allow_private: bool = True  # private, loopback, link-local... addresses (the server says False)

    @property
    def restricted(self) -> bool:
        return bool(self.hosts) or not self.allow_private


def fetch(url: str, policy: FetchPolicy = FetchPolicy()) -> bytes:
    """The body of `url` (http or https), following at most MAX_REDIRECTS redirects, each checked."""
    deadline = time.monotonic() + policy.timeout_s
    get = _get if policy.restricted else _get_by_urllib
    target = url
    for _ in range(MAX_REDIRECTS + 1):
        status, location, body = get(target, policy, deadline)
        if status in (301, 302, 303, 307, 308) and location:
            target = urljoin(target, location)
            continue
        if status != 200:
            moved = f" (redirected to {_short(target)})" if target != url else ""
            raise FetchError(f"could not download {_short(url)}{moved}: HTTP {status}")
        return body
    raise FetchError(f"{_short(url)}: more than {MAX_REDIRECTS} redirects")


def _http_parts(url: str):
    """`url` parsed, if it is an http(s) URL with a host."""
    parts = urlparse(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError(f"not an http(s) URL: {_short(url)}")
    return parts


def _get(url: str, policy: FetchPolicy, deadline: float) -> tuple[int, str | None, bytes]:
    parts = _http_parts(url)
    host = parts.hostname.lower()
    if policy.hosts and host not in policy.hosts:
        raise FetchError(f"host {host!r} is not among the hosts this server downloads from")
    address = _vetted_address(host, parts.port or (443 if parts.scheme == "https" else 80),
                              policy.allow_private or bool(policy.hosts))
    conn = _Connection(parts.scheme, host, parts.port, address, max(deadline - time.monotonic(), 0.1))
    # The socket's timeout bounds each read; a server that trickles its status line or headers a byte at a time
    # would pass every one: at the deadline the connection is shut down under whatever read waits.
    watchdog = threading.Timer(max(deadline - time.monotonic(), 0.0), conn.abort)
    watchdog.start()
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers=HEADERS)
        answer = _answer(conn.getresponse(), url, policy, deadline)
    except (OSError, http.client.HTTPException) as e:
        if conn.aborted:
            raise FetchError(f"{_short(url)}: the download took too long") from e
        raise FetchError(f"could not download {_short(url)}: {e}") from e
    finally:
        watchdog.cancel()
        conn.close()
    if conn.aborted:  # (a read cut short by the shutdown sees an end, not an error: what came is not the answer)
        raise FetchError(f"{_short(url)}: the download took too long")
    return answer


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects come back to `fetch`, which checks and counts them."""

    def redirect_request(self, *args, **kwargs):
        return None


def _get_by_urllib(url: str, policy: FetchPolicy, deadline: float) -> tuple[int, str | None, bytes]:
    _http_parts(url)
    opener = urllib.request.build_opener(_NoRedirect)  # (its ProxyHandler reads the environment's proxies now)
    try:
        with opener.open(urllib.request.Request(url, headers=HEADERS),
                          timeout=max(deadline - time.monotonic(), 0.1)) as response:
            return _answer(response, url, policy, deadline)
    except urllib.error.HTTPError as e:  # (any status but 2xx, redirects included)
        e.close()
        return e.code, e.headers.get("Location"), b""
    except (OSError, http.client.HTTPException) as e:
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        raise FetchError(f"could not download {_short(url)}: {reason}") from e


def _answer(response: http.client.HTTPResponse, url: str, policy: FetchPolicy, deadline: float
            ) -> tuple[int, str | None, bytes]:
    if response.status != 200:
        return response.status, response.getheader("Location"), b""
    length = response.getheader("Content-Length")
    if length and length.isdigit() and int(length) > policy.max_bytes:
        raise FetchError(f"{_short(url)} is {int(length)} bytes; the limit is {policy.max_bytes}")
    return 200, None, _read_limited(response, url, policy.max_bytes, deadline)


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
        self.scheme, self.address, self.aborted = scheme, address, False

    def connect(self) -> None:
        self.sock = socket.create_connection(self.address, self.timeout)
        if self.scheme == "https":
            self.sock = self._context.wrap_socket(self.sock, server_hostname=self.host)

    def abort(self) -> None:
        """Ends the connection from another thread: a read waiting on it returns at once."""
        self.aborted = True
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


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
