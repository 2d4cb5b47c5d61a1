"""intone on Ray Serve: the server's own FastAPI app (api/server.py `create_app`, the same routes,
lifespan and engine pool) as the replicas of one Ray Serve deployment, behind Ray's HTTP proxy.

    pip install 'intone[ray]'                      # on every host
    ray start --head --port 6379                   # the first host
    ray start --address FIRST_HOST:6379            # each other host
    serve run intone.deploy.ray:app_builder model=/models/s2-pro profile=fish-s2-high-concurrency \\
        num_gpus=1 min_replicas=1 max_replicas=8 target_ongoing_requests=48
    # or: serve deploy docs/deploy/ray-serve.yaml  (the same arguments in a config file)

Each replica is one intone server (an API process and its engine cores) on the GPUs Ray gives it
(`num_gpus`; with data_parallel=N, N cores on them). Replicas are autoscaled on Ray Serve's own
queue-depth signal, the requests ongoing at each replica (running and queued there): between
min_replicas and max_replicas, aiming at target_ongoing_requests per replica; num_replicas=K fixes
the count instead. Every response carries X-Intone-Replica (the Ray replica that answered).
Stored voices are per replica unless voices_dir is a filesystem all hosts share.

Arguments (`key=value` after `serve run`, or `args:` in a config file; values are strings there):
model, profile, served_model_name, api_key, device, devices (e.g. "0,1"), data_parallel, voices_dir,
allowed_local_media_path, allow_remote_media, max_input_chars, max_reference_seconds, sse_dialect,
text_workers, engine_restart, engine_hang_seconds, drain_seconds (Ray's graceful shutdown time),
num_replicas, min_replicas, max_replicas, target_ongoing_requests, max_ongoing_requests, num_gpus,
num_cpus.
"""

from __future__ import annotations

import os
from pathlib import Path

from ray import serve

from intone.api.engine_pool import parse_device
from intone.api.media import MediaPolicy
from intone.api.server import Settings, create_app

DEPLOYMENT = "intone"
SERVER_KEYS = {"model", "profile", "served_model_name", "api_key", "device", "devices", "data_parallel", "voices_dir",
               "allowed_local_media_path", "allow_remote_media", "max_input_chars", "max_reference_seconds",
               "sse_dialect", "text_workers", "engine_restart", "engine_hang_seconds", "drain_seconds"}
RAY_KEYS = {"num_replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "max_ongoing_requests",
            "num_gpus", "num_cpus"}
# One H200 serves Fish S2 Pro at 64 concurrent streams (its profile's max_num_seqs): more waits in the
# engine's queue, and Ray starts another replica when the average replica holds more than this.
TARGET_ONGOING = 48
MAX_ONGOING = 256  # what Ray's proxy sends one replica at most; the engine refuses beyond its own queue (503)


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes", "on")


def settings_from(args: dict) -> Settings:
    """The server's settings from the deployment's arguments (strings or typed values)."""
    unknown = set(args) - SERVER_KEYS - RAY_KEYS
    if unknown:
        raise ValueError(f"unknown arguments: {', '.join(sorted(unknown))} (known: "
                         f"{', '.join(sorted(SERVER_KEYS | RAY_KEYS))})")
    a = args.get
    devices = [parse_device(d) for d in str(a("devices")).split(",")] if a("devices") else None
    local = a("allowed_local_media_path")
    return Settings(
        model=a("model", "tiny:fish-s2"), profile=a("profile"), served_model_name=a("served_model_name"),
        api_key=a("api_key"), device=a("device"), devices=devices,
        data_parallel=int(a("data_parallel") or (len(devices) if devices else 1)),
        voices_dir=Path(a("voices_dir", "voices")),
        media=MediaPolicy(allowed_local_dir=Path(local) if local else None,
                          allow_remote=_flag(a("allow_remote_media", False)),
                          max_seconds=float(a("max_reference_seconds", 30.0))),
        max_input_chars=int(a("max_input_chars", 4096)), sse_dialect=a("sse_dialect", "openai"),
        text_workers=int(a("text_workers")) if a("text_workers") is not None else None,
        engine_restart=a("engine_restart", "restart"), engine_hang_s=float(a("engine_hang_seconds", 60.0)),
    )


def deployment_options(args: dict) -> dict:
    """Ray Serve's options for the deployment: replicas (fixed or autoscaled on ongoing requests),
    each replica's resources, and its drain time."""
    a = args.get
    options = dict(
        name=DEPLOYMENT, max_ongoing_requests=int(a("max_ongoing_requests", MAX_ONGOING)),
        graceful_shutdown_timeout_s=float(a("drain_seconds", 120.0)),
        ray_actor_options={"num_gpus": float(a("num_gpus", 0)), "num_cpus": float(a("num_cpus", 1))},
    )
    if a("num_replicas") is not None:
        options["num_replicas"] = int(a("num_replicas"))
    else:
        options["autoscaling_config"] = {
            "min_replicas": int(a("min_replicas", 1)), "max_replicas": int(a("max_replicas", 1)),
            "target_ongoing_requests": float(a("target_ongoing_requests", TARGET_ONGOING))}
    return options


class ReplicaHeader:
    """Names the replica that answered in every HTTP response (X-Intone-Replica)."""

    def __init__(self, app, replica: str):
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-intone-replica", self.replica)]}
            await send(message)
        await self.app(scope, receive, named)


def _replica_name() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (a test building the app): the process id will do
        return str(os.getpid())


def app_builder(args: dict) -> serve.Application:
    """`serve run intone.deploy.ray:app_builder key=value ...`: the intone deployment, bound."""
    settings = settings_from(args)

    def build():  # runs on each replica when it starts (Ray then runs the app's lifespan: the engines)
        app = create_app(settings)
        app.add_middleware(ReplicaHeader, replica=_replica_name())
        return app

    ingress = serve.ingress(build)()
    return serve.deployment(ingress, **deployment_options(args)).bind()
