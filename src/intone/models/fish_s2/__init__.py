"""Fish Audio S2 Pro: Dual-AR LM (slow AR over frames, fast AR over codebooks) + modded-DAC codec."""

from intone.models.fish_s2.model import FishS2
from intone.models.fish_s2.tiny import make_tiny_fish_s2

__all__ = ["FishS2", "make_tiny_fish_s2"]
