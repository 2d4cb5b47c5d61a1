"""Fish Audio S2 Pro: Dual-AR LM (slow AR over frames, fast AR over codebooks) + modded-DAC codec.

The model and the tiny maker load torch, so they come in on first use: the API process reads this
family's profile section (`options`) without it."""

__all__ = ["FishS2", "make_tiny_fish_s2"]


def __getattr__(name: str):
    if name == "FishS2":
        from intone.models.fish_s2.model import FishS2

        return FishS2
    if name == "make_tiny_fish_s2":
        from intone.models.fish_s2.tiny import make_tiny_fish_s2

        return make_tiny_fish_s2
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
