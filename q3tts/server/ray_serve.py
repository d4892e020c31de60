"""q3tts on Ray Serve: one replica per GPU, over as many hosts as the Ray cluster has (`pip install 'q3tts[ray]'`).

    serve run q3tts.ray_serve:build_app model=Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice num_replicas=2

Each replica is a whole `q3tts serve` app (the same OpenAI-compatible API, streaming, WebSocket, voices, limits
and errors) on its own GPU; Ray Serve's proxy is the ingress (port 8000) and sends each request to a replica
with few requests in flight (its power-of-two-choices router). A replica starts taking traffic once its engine
is warm; Ray restarts a replica whose engine has failed for good (`check_health`) or whose process died.

Arguments (`key=value` on `serve run`, or `args:` in a Serve config / KubeRay RayService):
- `model` (required), `dtype`, `max_running` (rows per replica, 64), `max_waiting` (queued requests per replica,
  256), `max_context`, `kv_cache_gb`, `prefix_cache_gb` (0.25), `gpu_memory_utilization` (0.9),
  `max_input_chars`, `api_key`,
  `served_model_name`, `allow_ref_audio_urls`, `ref_audio_hosts` (comma-separated), `runaway_guard` (true),
  `voice_aliases` (a mapping, or `alloy=vivian,ash=ryan`), `default_voice` (as `q3tts serve`'s flags).
- `voices_dir`: where uploaded voices live. Every replica must see the same folder (a shared volume on a
  cluster); required when there can be more than one replica, so that a voice uploaded to one replica is never
  missing on another.
- Placement: `num_gpus` per replica (1; 0 runs on the CPU), `num_cpus` per replica (1).
- Scale: `num_replicas` (fixed), or autoscaling with `min_replicas` / `max_replicas` and
  `target_ongoing_requests` (requests running or queued per replica that Ray aims for: default `max_running`, so
  that a replica is added once the rows fill and requests start to queue, and removed when load falls;
  `upscale_delay_s` 5 and `downscale_delay_s` 60 by default).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application

from . import ServerConfig, create_app
from .voice_aliases import parse_aliases

HEALTH_CHECK_PERIOD_S = 5.0


@serve.deployment(name="q3tts", health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=30,
                  graceful_shutdown_timeout_s=30)
@serve.ingress()
class Q3TTSReplica:
    """One engine and its HTTP app, built on the replica once Ray has placed it (on its GPU)."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.q3tts_app = None  # (`app` is Ray's: the wrapped ASGI app)

    def __serve_build_asgi_app__(self):
        self.q3tts_app = create_app(self.config, start_ready=True)
        return self.q3tts_app

    def check_health(self) -> None:
        """Ray replaces the replica when this raises: the engine failed and could not be rebuilt."""
        service = getattr(self.q3tts_app.state, "service", None) if self.q3tts_app is not None else None
        if service is not None and not service.healthy:
            raise RuntimeError(service.failure)


def build_app(args: dict[str, Any]) -> Application:
    """The Serve application for `args` (see the module's docstring); a ValueError names a bad argument."""
    args = dict(args)
    if "model" not in args:
        raise ValueError("q3tts.ray_serve: the `model` argument is required (a checkpoint folder or hub id)")
    num_gpus = _number(args.pop("num_gpus", 1), "num_gpus")
    num_cpus = _number(args.pop("num_cpus", 1), "num_cpus")
    scale = {key: args.pop(key) for key in ("num_replicas", "min_replicas", "max_replicas",
                                            "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s")
             if key in args}
    config = _server_config(args, device="cuda" if num_gpus else "cpu")
    options: dict[str, Any] = {"ray_actor_options": {"num_gpus": num_gpus, "num_cpus": num_cpus},
                               # Each replica queues up to max_waiting itself (429 beyond); Ray must not hold
                               # requests back before that, nor pile up more than one more replica's worth.
                               "max_ongoing_requests": config.max_running + config.max_waiting,
                               "max_queued_requests": config.max_waiting}
    if "num_replicas" in scale:
        if len(scale) > 1:
            raise ValueError("q3tts.ray_serve: give either num_replicas or the autoscaling arguments, not both")
        options["num_replicas"] = most = int(scale["num_replicas"])
    else:
        options["autoscaling_config"] = {
            "min_replicas": int(scale.get("min_replicas", 1)), "max_replicas": int(scale.get("max_replicas", 1)),
            "target_ongoing_requests": _number(scale.get("target_ongoing_requests", config.max_running),
                                               "target_ongoing_requests"),
            "upscale_delay_s": _number(scale.get("upscale_delay_s", 5), "upscale_delay_s"),
            "downscale_delay_s": _number(scale.get("downscale_delay_s", 60), "downscale_delay_s")}
        most = options["autoscaling_config"]["max_replicas"]
    if most < 1:
        raise ValueError(f"q3tts.ray_serve: at least one replica is needed, got {most}")
    if most > 1 and config.voices_dir is None:
        raise ValueError("q3tts.ray_serve: with more than one replica, give voices_dir=<a folder every replica "
                         "sees> (a shared volume on a cluster): otherwise a voice uploaded to one replica is "
                         "missing on the others")
    return Q3TTSReplica.options(**options).bind(config)


def _server_config(args: dict[str, Any], device: str) -> ServerConfig:
    fields = {"model": str, "dtype": str, "max_running": int, "max_waiting": int, "max_context": int,
              "kv_cache_gb": float, "prefix_cache_gb": float, "gpu_memory_utilization": float,
              "max_input_chars": int, "api_key": str,
              "served_model_name": str, "voices_dir": Path, "allow_ref_audio_urls": _boolean,
              "ref_audio_hosts": lambda v: tuple(h for h in str(v).split(",") if h), "runaway_guard": _boolean,
              "voice_aliases": _aliases, "default_voice": str}
    unknown = sorted(set(args) - set(fields))
    if unknown:
        raise ValueError(f"q3tts.ray_serve: unknown argument(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(fields))}, num_gpus, num_cpus, num_replicas, min_replicas, "
                         "max_replicas, target_ongoing_requests, upscale_delay_s, downscale_delay_s")
    values = {}
    for key, value in args.items():
        try:
            values[key] = fields[key](value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"q3tts.ray_serve: {key}={value!r}: {e}") from None
    if values.pop("runaway_guard", True) is False:
        values["runaway_guard"] = None
    return ServerConfig(device=device, **values)


def _aliases(value: Any) -> dict[str, str]:
    """A mapping (a Serve config's `args`), or `name=voice,name=voice` (a `serve run` argument)."""
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    return parse_aliases([item for item in str(value).split(",") if item.strip()])


def _number(value: Any, name: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"q3tts.ray_serve: {name} must be a number, got {value!r}") from None
    if number < 0:
        raise ValueError(f"q3tts.ray_serve: {name} must be >= 0, got {value!r}")
    return int(number) if number.is_integer() else number


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")
