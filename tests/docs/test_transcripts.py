"""The WebSocket sessions the docs show message by message (```text blocks marked `<!-- snippet: transcript -->`:
lines `→ {json}` the client sends, `← {json}`, `← (binary ...)` and `← (close N)` the server's) are replayed against a
real server of the tiny CustomVoice model: the server must send the same messages in the same order, each with the
same keys (and the same `type`, texts, formats and error fields), binary audio where the page shows it, and close
with the code shown. Numbers (ids, seeds, sizes, frames) differ and are not compared."""

from __future__ import annotations

import json

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from .snippets import blocks, pages

COMPARED = ("type", "text", "sentence_text", "format", "response_format", "param", "code")
TRANSCRIPTS = [b for p in pages() for b in blocks(p) if "transcript" in b.words]


def documented(block) -> tuple[list[dict], list]:
    """(the client's messages, the server's: dicts, "binary" or ("close", code)) of a transcript block."""
    sent, received = [], []
    for line in block.code.splitlines():
        arrow, _, body = line.strip().partition(" ")
        if arrow == "→":
            sent.append(json.loads(body))
        elif arrow == "←" and body.startswith("(binary"):
            received.append("binary")
        elif arrow == "←" and body.startswith("(close"):
            received.append(("close", int(body.strip("()").split()[1])))
        elif arrow == "←":
            received.append(json.loads(body))
    return sent, received


def replay(url: str, sent: list[dict]) -> list:
    """The server's messages to `sent` (runs of binary frames as one "binary"), and how it closed."""
    got = []
    with connect(url + "/v1/audio/speech/stream") as ws:
        for message in sent:
            ws.send(json.dumps(message))
        try:
            while True:
                message = ws.recv(timeout=60)
                if isinstance(message, bytes):
                    if got[-1:] != ["binary"]:
                        got.append("binary")
                else:
                    got.append(json.loads(message))
        except ConnectionClosed as e:
            got.append(("close", e.rcvd.code if e.rcvd else None))
    return got


def shape(message):
    if isinstance(message, dict):
        return {key: message[key] if key in COMPARED else type(message[key]).__name__ for key in message}
    return message


@pytest.mark.parametrize("block", TRANSCRIPTS, ids=[b.where for b in TRANSCRIPTS])
def test_transcript_is_what_the_server_sends(block, hub, servers):
    sent, expected = documented(block)
    got = replay("ws://" + servers.url("custom_voice"), sent)
    want, have = [shape(m) for m in expected], [shape(m) for m in got]
    assert have == want, f"{block.where}: the server sent\n{json.dumps(got, indent=1)[:4000]}"
