"""Fish S2's section of a deploy profile (`fish_s2:`): the knobs only this family has.

Torch-free (the API process validates profiles); the model reads it in `configure_frontend`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class FishS2Options(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reference_rows: int = Field(16, ge=1, le=64, description="reference clips per codec-encoder call at most "
                                "(rows padded to a power of two; 1: each clip alone, no blank rows and no padding "
                                "to another clip's length)")
    reference_bucket_s: float = Field(2.0, ge=0.25, le=30, description="a call's clips padded to a multiple of this "
                                      "many seconds (in codec frames: each length one more shape to warm at "
                                      "start-up, up to 10 s)")
    encoder_layout: Literal["channels_first", "time_major"] = Field(
        "channels_first", description="the reference encoder's activations: [B, C, T] as the official code keeps "
        "them, or time-major [B, T, C] (cuDNN's channels-last layout on a GPU: no layout conversion around each "
        "convolution; the same sums, other kernels, so a code may differ where a latent sits between two entries)")
    decoder_layout: Literal["channels_first", "time_major"] = Field(
        "channels_first", description="the carried codec decoder's activations and histories (codec.carry_state): "
        "[B, C, T] as the official code keeps them, or time-major [B, T, C] (no layout conversion around each "
        "convolution on a GPU; the same sums, other kernels: the audio within half-precision rounding)")
