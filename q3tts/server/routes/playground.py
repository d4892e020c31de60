"""`GET /`: the web playground, one static page in the package (no build step, nothing fetched from elsewhere).
Pick a speaker, an uploaded voice or a voice description as the checkpoint allows, type text, hear it as it is
generated, see the time to first audio and the real-time factor, download the audio, upload a recording to make
a voice. It calls the public API (/v1/models, /v1/audio/voices, /v1/audio/speech) like any client."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()
PAGE = Path(__file__).parent.parent / "static" / "index.html"


@cache
def _page() -> str:
    return PAGE.read_text(encoding="utf-8")


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def playground() -> HTMLResponse:
    return HTMLResponse(_page())
