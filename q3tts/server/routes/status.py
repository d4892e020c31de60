"""What the server says about itself: `/health` (liveness: the engine thread is healthy), `/ready` (the engine
captured its graphs and served a warm-up request), `/metrics` (Prometheus) and `/v1/models` (OpenAI's list, and
`/v1/models/{model}` its retrieval: the names a request's `model` may take, checkpoint ids with their slash too)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from ..metrics import CONTENT_TYPE
from ..service import SpeechService

router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request) -> JSONResponse:
    service: SpeechService = request.app.state.service
    if service.healthy:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unhealthy", "detail": service.failure or "the engine has failed"},
                        status_code=503)


@router.api_route("/ready", methods=["GET", "HEAD"])
async def ready(request: Request) -> JSONResponse:
    service: SpeechService = request.app.state.service
    is_ready = service.ready and service.healthy and not service.draining and bool(service.engine) \
        and service.engine.healthy
    return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [_served_model(request)]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> dict:
    """OpenAI's model retrieval (the openai SDK's `models.retrieve`): the served model, by any name a request's
    `model` may give it, else the 404 such a request gets."""
    request.app.state.service.check_model(model)
    return _served_model(request)


def _served_model(request: Request) -> dict:
    service: SpeechService = request.app.state.service
    config = service.tts.config
    return {"id": service.config.model_id, "object": "model", "created": request.app.state.started_at,
            "owned_by": "q3tts", "task_type": service.task_type, "model_size": config.tts_model_size,
            "sample_rate": service.tts.sample_rate, "languages": service.tts.get_supported_languages(),
            "speakers": service.tts.get_supported_speakers(), "instructions": config.supports_instruct}
