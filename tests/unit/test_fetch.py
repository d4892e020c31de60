"""Reference audio from URLs within limits (q3tts/request/fetch.py): size, time, redirects, hosts, private addresses."""

from __future__ import annotations

import contextlib
import http.server
import threading
import time

import pytest

from q3tts.request.fetch import FetchError, FetchPolicy, fetch

BODY = b"RIFF" + b"x" * 5000


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # (a client hung up at its limit, as asked)
            self._answer()

    def _answer(self) -> None:
        if self.path in ("/audio.wav", "http://audio.invalid/proxied.wav"):  # (the second: asked of a proxy)
            self._send(200, BODY)
        elif self.path == "/big.wav":  # no Content-Length: the limit must hold while reading
            self.send_response(200)
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"y" * 65536)
        elif self.path == "/slow.wav":
            self.send_response(200)
            self.end_headers()
            for _ in range(50):
                self.wfile.write(b"z" * 100)
                self.wfile.flush()
                time.sleep(0.1)
        elif self.path == "/trickled-headers.wav":  # every read within the socket's timeout, the whole never
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            for _ in range(60):
                self.wfile.write(b"X")
                self.wfile.flush()
                time.sleep(0.1)
        elif self.path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.end_headers()
        elif self.path == "/moved":
            self.send_response(301)
            self.send_header("Location", "/audio.wav")
            self.end_headers()
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def base_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_download_and_redirect(base_url):
    assert fetch(f"{base_url}/audio.wav") == BODY
    assert fetch(f"{base_url}/moved") == BODY


@pytest.mark.parametrize(("path", "policy", "match"), [
    ("/big.wav", FetchPolicy(max_bytes=100_000), "the limit is 100000"),
    ("/slow.wav", FetchPolicy(timeout_s=0.5), "too long|timed out"),
    ("/slow.wav", FetchPolicy(timeout_s=0.5, hosts=("127.0.0.1",)), "too long"),
    ("/trickled-headers.wav", FetchPolicy(timeout_s=0.5, hosts=("127.0.0.1",)), "took too long"),
    ("/loop", FetchPolicy(), "/loop: more than 10 redirects"),
    ("/loop", FetchPolicy(hosts=("127.0.0.1",)), "/loop: more than 10 redirects"),
    ("/missing.wav", FetchPolicy(), "could not download .*HTTP 404"),
    ("/audio.wav", FetchPolicy(allow_private=False), "private, loopback or link-local"),
    ("/audio.wav", FetchPolicy(hosts=("example.org",)), "not among the hosts"),
])
def test_limits(base_url, path, policy, match):
    started = time.monotonic()
    with pytest.raises(FetchError, match=match):
        fetch(base_url + path, policy)
    assert time.monotonic() - started < 3


def test_an_allowed_host_may_be_private(base_url):
    assert fetch(f"{base_url}/audio.wav", FetchPolicy(hosts=("127.0.0.1",), allow_private=False)) == BODY


@pytest.mark.parametrize("url", ["ftp://example.org/a.wav", "file:///etc/passwd", "http:///nohost"])
def test_only_http_urls(url):
    with pytest.raises(FetchError, match="not an http"):
        fetch(url)


def test_the_environments_proxy_is_used(base_url, monkeypatch):
    """As urllib (the official API's download) does, the Python API goes through the proxy the environment names:
    here to a host that does not resolve, which only the proxy serves."""
    for name in ("no_proxy", "NO_PROXY", "HTTP_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("http_proxy", base_url)
    assert fetch("http://audio.invalid/proxied.wav") == BODY
    with pytest.raises(FetchError, match="not among the hosts"):  # (the server's restricted policy connects itself)
        fetch("http://audio.invalid/proxied.wav", FetchPolicy(hosts=("127.0.0.1",)))
