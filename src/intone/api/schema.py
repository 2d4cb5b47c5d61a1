"""The request bodies of the speech API and the error body every failure uses."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from intone.sampling_bounds import SAMPLING_BOUNDS, SPEED_BOUNDS

ResponseFormat = Literal["wav", "pcm", "flac", "mp3", "opus", "aac"]


def unicode_text(value):
    """JSON may carry lone surrogates (\\ud800), which are not text: refuse them here, naming the field."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("contains a lone surrogate: not valid Unicode text") from None
    return value


class ReferenceIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    audio: str | None = None  # data: URL, file:// URL or path, or http(s) URL when enabled
    audio_path: str | None = None  # SGLang-Omni's name for a local path
    text: str = Field(min_length=1)

    _text_only = field_validator("audio", "audio_path", "text")(unicode_text)

    @model_validator(mode="after")
    def _one_source(self):
        if (self.audio is None) == (self.audio_path is None):
            raise ValueError("give exactly one of audio or audio_path")
        return self


class SpeechRequest(BaseModel):
    """OpenAI's /v1/audio/speech body, plus the fields vLLM-Omni and SGLang-Omni clients send.
    Strict types: `true` is not a number and "5" not an integer (JSON clients send the real types)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    input: str
    model: str | None = None
    voice: str | None = None  # a name, or the OpenAI SDK's custom-voice object {"id": name}
    response_format: ResponseFormat = "wav"
    speed: float = Field(1.0, **SPEED_BOUNDS)
    stream: bool = False
    stream_format: Literal["sse", "audio"] | None = None
    ref_audio: str | None = None
    ref_text: str | None = None
    references: list[ReferenceIn] | None = None
    max_new_tokens: int | None = Field(None, **SAMPLING_BOUNDS["max_new_tokens"])
    seed: int | None = Field(None, **SAMPLING_BOUNDS["seed"])
    temperature: float | None = Field(None, **SAMPLING_BOUNDS["temperature"])
    top_p: float | None = Field(None, **SAMPLING_BOUNDS["top_p"])
    top_k: int | None = Field(None, **SAMPLING_BOUNDS["top_k"])
    repetition_penalty: float | None = Field(None, **SAMPLING_BOUNDS["repetition_penalty"])
    sampling_mode: Literal["ras", "standard"] | None = None  # the model's sampling mode (default: profile's)
    instructions: str | None = Field(None, max_length=1000)  # OpenAI's style instruction (CosyVoice3 instruct2)
    min_new_tokens: int | None = Field(None, **SAMPLING_BOUNDS["min_new_tokens"])
    initial_codec_chunk_frames: int | None = Field(None, ge=0, le=1024)
    ignore_eos: bool = False  # benchmarks: generate exactly max_new_tokens frames

    _text_only = field_validator("input", "ref_text", "ref_audio", "instructions", "voice", "model")(unicode_text)

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_name(cls, voice):
        if isinstance(voice, dict):
            if not isinstance(voice.get("id"), str):
                raise ValueError('a voice object needs a string "id"')
            return voice["id"]
        return voice


class ErrorDetail(BaseModel):
    message: str
    type: str  # invalid_request_error, authentication_error or server_error
    param: str | None = None  # the request field it is about
    code: str | None = None  # e.g. queue_full, engine_dead


class ErrorBody(BaseModel):
    """What every failure answers (OpenAI's error shape)."""

    error: ErrorDetail


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
