"""Named workloads for `intone bench --preset`: the settings our quoted numbers come from.

A preset fills in every load flag the user did not give; a flag given explicitly always wins.
The CLI's defaults for these flags are therefore None ("not given"), resolved here.
"""

from __future__ import annotations

from intone.errors import IntoneError

# The values a flag takes when neither the user nor a preset sets it.
DEFAULTS = dict(dataset="synthetic", num_requests=64, concurrency="1", warmup=4, force_output_frames=None,
                reference_pool=None)

# Seed-TTS protocol means: Fish S2 Pro 86 frames, CosyVoice3 128 speech tokens per utterance.
PRESETS = {
    "seedtts-fish": dict(dataset="synthetic", num_requests=1088, concurrency="64", warmup=64,
                         force_output_frames="normal:86:30"),
    "seedtts-cosyvoice3": dict(dataset="synthetic", num_requests=1088, concurrency="64", warmup=64,
                               force_output_frames="normal:128:45"),
}


def apply_preset(args) -> None:
    """Fill args' unset (None) load flags from args.preset, then from DEFAULTS. Idempotent."""
    name = getattr(args, "preset", None)
    if name and name not in PRESETS:
        raise IntoneError(f"--preset: unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    preset = PRESETS.get(name, {}) if name else {}
    for key, default in DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, preset.get(key, default))
