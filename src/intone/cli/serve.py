"""`intone serve`: the OpenAI-compatible speech server (API process + engine core process)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import uvicorn
import yaml

from intone.api.engine_pool import parse_device
from intone.api.media import MediaPolicy
from intone.api.server import Settings, create_app


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve /v1/audio/speech over HTTP")
    p.add_argument("--model", default="tiny:fish-s2", help="checkpoint directory or tiny:<family>")
    p.add_argument("--profile", default=None, help="deploy profile (path or name under profiles/)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the id /v1/models reports")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="ref_audio may name local files under DIR (paths or file:// URLs)")
    p.add_argument("--allow-remote-media", action="store_true",
                   help="ref_audio may be an http(s) URL of a public host")
    p.add_argument("--allow-private-media", action="store_true",
                   help="with --allow-remote-media: loopback and private-network hosts too (never link-local)")
    p.add_argument("--voices-dir", default="voices", help="where uploaded voices are stored")
    p.add_argument("--max-input-chars", type=int, default=4096)
    p.add_argument("--max-reference-seconds", type=float, default=30.0)
    p.add_argument("--sse-dialect", choices=["openai", "sglang", "audio"], default="openai",
                   help="what stream=true without stream_format answers: OpenAI's SSE events, SGLang-Omni's, "
                        "or raw audio bytes (older vLLM-Omni clients); an explicit stream_format always wins")
    p.add_argument("--voice-alias", action="append", default=[], type=voice_alias, metavar="NAME=VOICE",
                   help="a request's voice NAME means the stored VOICE (or 'default'); repeatable")
    p.add_argument("--device", default=None, help="overrides the profile's device")
    p.add_argument("--data-parallel", type=positive_int, default=None, metavar="N",
                   help="N engine cores behind this one server (default: one per --devices entry, else 1); each "
                        "request goes to the core that owes the fewest frames, or to the one that has its "
                        "reference clip cached unless that one is much busier; a core that dies is restarted "
                        "while the others serve")
    p.add_argument("--devices", type=device_list, default=None, metavar="LIST",
                   help="comma-separated devices of the engine cores, core k on entry k (cycled when N is "
                        "larger, so '0,0' puts two small cores on GPU 0): GPU indices (0, 1 or cuda:1; the core "
                        "sees only that GPU) or cpu")
    p.add_argument("--set", action="append", default=[], type=profile_override, metavar="KEY=VALUE", dest="overrides",
                   help="override one profile value, e.g. codec.process=true or ar.max_num_seqs=32 (YAML value); "
                        "repeatable")
    p.add_argument("--trace-frames", default=None, metavar="FILE",
                   help="one JSON line per chunk sent (with several cores, core k writes FILE's stem.k.suffix)")
    p.add_argument("--profile-dir", default=None, metavar="DIR",
                   help="enable POST /start_profile and /stop_profile: a torch profiler window over the served load "
                        "in each engine core, its trace and summary (GPU busy time per thread and stream) written "
                        "under DIR/engine-K/ (diagnostics: profiling slows the engine, and a window "
                        "over CUDA graphs can crash a core, which is then restarted)")
    p.add_argument("--engine-silence-seconds", type=float, default=10.0,
                   help="/health answers 503 once the engine core has been silent this long (hung)")
    p.add_argument("--engine-restart", choices=["restart", "exit"], default="restart",
                   help="when the engine core dies: start a new one (back-off 1 s doubling to 60 s), or stop the server")
    p.add_argument("--engine-hang-seconds", type=float, default=60.0,
                   help="kill (then restart) an engine core whose loop is silent this long (0: never)")
    p.add_argument("--drain-seconds", type=float, default=120.0,
                   help="on SIGTERM, how long in-flight requests may take to finish (then: 503 / cut streams)")
    p.add_argument("--text-workers", type=int, default=None, metavar="N",
                   help="processes that normalise request texts (CosyVoice3's wetext) beside the API's own "
                        "interpreter; 0: its threads (default: a quarter of the cores, up to 4)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(run=run)


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: use a whole number >= 1")
    return int(text)


def device_list(text: str) -> list[str]:

    try:
        return [parse_device(part) for part in text.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def voice_alias(text: str) -> tuple[str, str]:
    name, sep, voice = text.partition("=")
    if not sep or not name.strip() or not voice.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: use NAME=VOICE")
    return name.strip(), voice.strip()


def profile_override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: use KEY=VALUE, e.g. codec.process=true")
    return key.strip(), yaml.safe_load(value)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = Settings(
        model=args.model, profile=args.profile, served_model_name=args.served_model_name, api_key=args.api_key,
        media=MediaPolicy(
            allowed_local_dir=Path(args.allowed_local_media_path) if args.allowed_local_media_path else None,
            allow_remote=args.allow_remote_media, allow_private=args.allow_private_media,
            max_seconds=args.max_reference_seconds,
        ),
        voices_dir=Path(args.voices_dir), max_input_chars=args.max_input_chars, sse_dialect=args.sse_dialect,
        voice_aliases=dict(args.voice_alias), device=args.device, profile_overrides=dict(args.overrides),
        trace_frames=args.trace_frames,
        engine_silence_s=args.engine_silence_seconds, engine_restart=args.engine_restart,
        engine_hang_s=args.engine_hang_seconds, text_workers=args.text_workers,
        data_parallel=args.data_parallel or (len(args.devices) if args.devices else 1), devices=args.devices,
        profile_dir=Path(args.profile_dir) if args.profile_dir else None,
    )
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.drain_seconds)
    return 0
