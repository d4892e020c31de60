"""`/v1/audio/voices`: list the preset speakers, stored voices and voice aliases, upload reference audio to clone a
voice (Base checkpoints), fetch or delete a stored voice. A stored voice's id (or name) is a `voice` for
`/v1/audio/speech` and the WebSocket.

An upload is q3tts's form (`file`, `ref_text`, `name`, `x_vector_only_mode`) or OpenAI's custom-voice request as
the openai SDK's `audio.voices.create` sends it (`audio_sample`, `consent`, `name`; vLLM-Omni's adds `ref_text` and
`speaker_description`), which is answered in OpenAI's voice-object shape (`"object": "audio.voice"`, `"type":
"audio_sample"`). OpenAI's request carries no transcript: without `ref_text` its voice is cloned from the speaker
embedding alone (x_vector_only_mode), as vLLM-Omni does. `consent` (OpenAI's consent recording id) and
`speaker_description` are checked and not kept."""

from __future__ import annotations

import asyncio
import email.message
import re
from typing import Annotated

from fastapi import APIRouter, Depends, File, Form, Request, UploadFile
from starlette.datastructures import UploadFile as StarletteUploadFile

from ...errors import quote
from ...request.voice_blend import is_mix
from .. import errors
from ..body import read_json_value
from ..service import SpeechService
from ..voice_choice import PLACEHOLDER_VOICES
from ..voice_store import VoiceStoreError

router = APIRouter()  # authentication: guard.py
_NAME = re.compile(r"[\w.\- ]{1,64}")
UPLOAD_FIELDS = ("file", "ref_text", "name", "x_vector_only_mode", "audio_sample", "consent", "type",
                 "speaker_description")
FILE_FIELDS = ("file", "audio_sample")
MAX_MIX_CHARS = 1000
PROMPT_FIELDS = ("prompt", "model", "script_hint")  # OpenAI's voices made from a description
COMBINE_BODY = (f'a JSON string such as "a(2)+b(1)" (at most {MAX_MIX_CHARS} characters), or a list of stored '
                'voices\' names such as ["a", "b"]')


@router.get("/v1/audio/voices")
async def list_voices(request: Request) -> dict:
    """`data`: the preset speakers and stored voices; `aliases` and `default_voice`: the names that stand for them
    (voice_aliases.py); `voices` (the names of all of those) and `uploaded_voices`: the lists of vLLM-Omni's,
    SGLang-Omni's and Kokoro-FastAPI's answer."""
    service: SpeechService = request.app.state.service
    presets = [_preset(name) for name in service.tts.get_supported_speakers()]
    stored = [entry.to_json() for entry in await asyncio.to_thread(service.voices.list)]
    aliases = service.resolver.listing()
    names = [v["name"] for v in presets + stored] + [a["name"] for a in aliases["aliases"]]
    return {"object": "list", "task_type": service.task_type, "data": presets + stored, **aliases,
            "voices": list(dict.fromkeys(names)), "uploaded_voices": stored}


async def strict_form(request: Request) -> None:
    """Refuses what FastAPI's form parameters let through: an unknown field (ignored), a repeated one (the last
    kept), a field sent in the query (ignored), a boolean other than true/false ("yes", "on" and "1" read as true),
    text where a file belongs, and a body that is no form at all (a bare audio file or JSON: 415, not "file: Field
    required")."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type not in ("multipart/form-data", "application/x-www-form-urlencoded"):
        sent = f"Content-Type {quote(media_type)}" if media_type else "no Content-Type"
        raise errors.APIError(415, f"a voice upload is a multipart form (curl -F file=@voice.wav -F ref_text=...); "
                                   f"this one came with {sent}", code="unsupported_media_type")
    query = list(request.query_params)
    if query:  # (the form's fields are read from the form alone: ?name=amy was dropped)
        raise errors.bad_request(f"query parameter {quote(query[0])}: a voice upload takes its fields in the form "
                                 f"(curl -F name=...), not in the query", param=errors.field(query[0]))
    if media_type == "multipart/form-data":
        _check_complete(request)
    form = await request.form()
    names = [name for name, _ in form.multi_items()]
    for name in names:
        if name in PROMPT_FIELDS or (name == "type" and form.get("type") == "prompt"):
            raise errors.bad_request("voices made from a description (OpenAI's type \"prompt\") are not supported: "
                                     "upload a recording as audio_sample, or describe the voice in `instructions` on "
                                     "a VoiceDesign checkpoint", param=name)
        if name not in UPLOAD_FIELDS:
            raise errors.bad_request(f"unknown field {quote(name)}; a voice upload takes {', '.join(UPLOAD_FIELDS)}",
                                     param=errors.field(name))
        if names.count(name) > 1:
            raise errors.bad_request(f"{name} is sent {names.count(name)} times; send it once", param=name)
    for name in FILE_FIELDS:
        if name in form and not isinstance(form[name], StarletteUploadFile):
            raise errors.bad_request(f"{name} must be a file part (curl -F {name}=@voice.wav)", param=name)
    if sum(name in form for name in FILE_FIELDS) != 1:
        raise errors.bad_request("send the recording as `file` (or OpenAI's `audio_sample`), once",
                                 param="file", code="missing" if not any(n in form for n in FILE_FIELDS) else
                                 "invalid_value")
    for name in ("consent", "type", "speaker_description"):
        if name in form and not isinstance(form[name], str):
            raise errors.bad_request(f"{name} must be text, not a file", param=name)
    if form.get("type", "audio_sample") != "audio_sample":
        raise errors.bad_request(f"type must be audio_sample, not {quote(form['type'])}", param="type")
    if len(form.get("consent", "")) > 256 or len(form.get("speaker_description", "")) > 2000:
        raise errors.bad_request("consent is at most 256 characters, speaker_description 2000",
                                 param="consent" if len(form.get("consent", "")) > 256 else "speaker_description")
    if isinstance(form.get("name"), str):  # (here: FastAPI reads an empty field as one not sent)
        _check_name(form["name"])
    flag = form.get("x_vector_only_mode")
    if flag is not None and (not isinstance(flag, str) or flag.lower() not in ("true", "false")):
        shown = quote(flag) if isinstance(flag, str) else "a file"
        raise errors.bad_request(f"x_vector_only_mode must be true or false, not {shown}", param="x_vector_only_mode")


def _check_complete(request: Request) -> None:
    """A multipart body ends with its closing boundary; without it the client's upload was cut off (the form
    parser leaves the unfinished part out, which would read as a field not sent)."""
    header = email.message.Message()
    header["content-type"] = request.headers["content-type"]
    boundary = str(header.get_param("boundary") or "").encode()
    tail = request.scope.get("state", {}).get("body_tail")  # (None: no RequestContextMiddleware noted it)
    if boundary and tail is not None and b"--" + boundary + b"--" not in tail:
        raise errors.bad_request("the multipart form is incomplete: its closing boundary never came (was the "
                                 "upload cut off?)", code="incomplete_form")


@router.post("/v1/audio/voices", status_code=201, dependencies=[Depends(strict_form)])
async def create_voice(request: Request, file: Annotated[UploadFile | None, File()] = None,
                       audio_sample: Annotated[UploadFile | None, File()] = None,
                       ref_text: Annotated[str | None, Form()] = None, name: Annotated[str | None, Form()] = None,
                       x_vector_only_mode: Annotated[bool | None, Form()] = None) -> dict:
    """Clones a voice from an uploaded recording (with its transcript unless x_vector_only_mode) and stores it."""
    service: SpeechService = request.app.state.service
    openai_shape, param = audio_sample is not None, "file" if file is not None else "audio_sample"
    file = file or audio_sample
    if x_vector_only_mode is None:  # (OpenAI's request has no transcript: the speaker embedding alone)
        x_vector_only_mode = openai_shape and not ref_text
    if ref_text is not None and len(ref_text) > service.config.max_ref_text_chars:
        raise errors.bad_request(f"ref_text is {len(ref_text)} characters; this server accepts at most "
                                 f"{service.config.max_ref_text_chars}", param="ref_text", code="too_long")
    data = await file.read(service.config.max_upload_bytes + 1)
    if len(data) > service.config.max_upload_bytes:
        raise errors.APIError(413, f"the upload exceeds {service.config.max_upload_bytes} bytes", param=param,
                              code="file_too_large")
    voice = await service.create_voice(data, ref_text or None, x_vector_only_mode, param=param)
    try:
        entry = await asyncio.to_thread(service.voices.add, voice, name)
    except ValueError as e:
        raise errors.APIError(409, str(e), param="name", code="voice_exists") from e
    return {**entry.to_json(), "object": "audio.voice", "type": "audio_sample"} if openai_shape else entry.to_json()


def _preset_speaker(service: SpeechService, name: str) -> str | None:
    """The preset speaker `name` is, in any case, as a request's `voice` matches it ("Ryan" is ryan)."""
    return next((s for s in service.tts.get_supported_speakers() if s.lower() == name.lower()), None)


def _preset(name: str) -> dict:
    return {"id": name, "object": "voice", "type": "preset", "name": name}


def _check_name(name: str | None) -> None:
    """A stored voice's name, one a request can select it by: not a placeholder for no voice, no space around it
    (a request's `voice` is matched as sent), not dots alone (a URL's path cannot carry it: clients resolve /. and
    /.. before they send it)."""
    if name is None:
        return
    if not _NAME.fullmatch(name):
        raise errors.bad_request("name: 1-64 letters, digits, spaces, '.', '_' or '-'", param="name")
    if not name.strip("."):
        raise errors.bad_request(f"name {quote(name)} is only dots, which /v1/audio/voices/{{name}} cannot carry: "
                                 "choose another", param="name")
    if name != name.strip():
        raise errors.bad_request(f"name {quote(name)} starts or ends with a space: a request could not select it",
                                 param="name")
    if name in PLACEHOLDER_VOICES:
        raise errors.bad_request(f"name {quote(name)} means no voice in a request's `voice`: choose another",
                                 param="name")


@router.post("/v1/audio/voices/combine", status_code=201)
async def combine_voices(request: Request, name: str | None = None) -> dict:
    """Kokoro-FastAPI's voice combination: the JSON body is a mix of stored voices ("a(2)+b(1)") or a list of
    their names (equal weights). The blend (voice_blend.py) is stored as a new voice named `name` (query), else
    the mix as sent; answered with the stored voice and Kokoro's `voice` (its name) and `voices` (every name)."""
    service: SpeechService = request.app.state.service
    unknown = [key for key in request.query_params if key != "name"]
    if unknown:  # (FastAPI ignores them: a misspelt ?name= would store the blend under the mix, silently)
        raise errors.bad_request(f"unknown query parameter {quote(unknown[0])}; combine takes only ?name=",
                                 param=errors.field(unknown[0]))
    if len(request.query_params.getlist("name")) > 1:  # (FastAPI keeps the last one, silently)
        raise errors.bad_request("name is sent more than once; send it once", param="name")
    mix = _mix(read_json_value(request.headers.get("content-type"), await request.body(), COMBINE_BODY))
    if service.resolver.kind != "base":
        raise errors.bad_request(f"voice blends mix cloned voices, which needs a Base checkpoint; this one is "
                                 f"{service.task_type}", param="voices")
    _check_name(name)
    voice = await service.resolver.named.mixed(mix, "voices")
    try:
        entry = await asyncio.to_thread(service.voices.add, voice, name or mix)
    except ValueError as e:
        raise errors.APIError(409, f"{e}: pass another ?name=", param="name", code="voice_exists") from e
    names = [v.name for v in await asyncio.to_thread(service.voices.list)]
    # (type "cloned", as GET and the list report it: the store does not keep that a voice was blended)
    return {**entry.to_json(), "voice": entry.name, "voices": names}


def _mix(body: object) -> str:
    """Kokoro's combine body, a mix "a(2)+b(1)" or a list of names, as one mix."""
    if isinstance(body, list) and body and all(isinstance(n, str) and n.strip() and not is_mix(n) for n in body):
        return "+".join(n.strip() for n in body)
    if isinstance(body, str) and body.strip() and len(body) <= MAX_MIX_CHARS:
        return body.strip()
    raise errors.bad_request(f"the request body is the voices to combine: {COMBINE_BODY}", param="voices")


@router.get("/v1/audio/voices/{voice_id}")
async def get_voice(voice_id: str, request: Request) -> dict:
    try:
        found = await asyncio.to_thread(request.app.state.service.voices.get, voice_id)
    except VoiceStoreError as e:
        raise errors.APIError(500, str(e), type=errors.SERVER, param="voice_id", code="voice_unreadable") from None
    if found is not None:
        return found[0].to_json()
    if (speaker := _preset_speaker(request.app.state.service, voice_id)) is not None:  # (listed beside the stored)
        return _preset(speaker)
    raise errors.not_found(f"voice {quote(voice_id)} not found", param="voice_id", code="voice_not_found")


@router.delete("/v1/audio/voices/{voice_id}")
async def delete_voice(voice_id: str, request: Request) -> dict:
    service: SpeechService = request.app.state.service
    entry = await asyncio.to_thread(service.voices.delete, voice_id)
    if entry is None and _preset_speaker(service, voice_id) is not None:
        raise errors.bad_request(f"{quote(voice_id)} is one of the checkpoint's preset speakers: only stored voices "
                                 "can be deleted", param="voice_id")
    if entry is None:
        raise errors.not_found(f"voice {quote(voice_id)} not found", param="voice_id", code="voice_not_found")
    return {"id": entry.id, "object": "audio.voice.deleted", "deleted": True}  # OpenAI's VoiceDeleted
