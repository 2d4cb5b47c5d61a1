"""Where a model's files are: a checkpoint directory, or a `tiny:<family>` one made once in the cache."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

from intone.errors import ModelLoadError

# "module:attribute", imported on use: only the family asked for is loaded, and the families
# (which call resolve_model_dir) are not imported from below them.
TINY_MAKERS = {
    "fish-s2": "intone.models.fish_s2.tiny:make_tiny_fish_s2",
    "cosyvoice3": "intone.models.cosyvoice3.tiny:make_tiny_cosyvoice3",
}


def import_ref(ref: str):
    """`"package.module:attribute"` -> the attribute."""
    module, attr = ref.split(":")
    return getattr(__import__(module, fromlist=[attr]), attr)


# One tiny model made at a time in a process: torch's ONNX export (CosyVoice3's tiny frontend) keeps a
# process-wide flag, so two threads exporting at once fail; the second then finds the first's model made.
_making = threading.Lock()


def cache_dir() -> Path:
    return Path(os.environ.get("INTONE_CACHE", Path.home() / ".cache" / "intone"))


def make_tiny(family: str, out_dir: str | Path, seed: int = 0) -> Path:
    if family not in TINY_MAKERS:
        raise ModelLoadError(f"unknown tiny model {family!r}; known: {', '.join(TINY_MAKERS)}")
    return import_ref(TINY_MAKERS[family])(out_dir, seed=seed)


def resolve_model_dir(spec: str) -> Path:
    """`tiny:<family>` is made once in the cache directory (atomically), then reused."""
    if not spec.startswith("tiny:"):
        path = Path(spec)
        if not path.is_dir():
            raise ModelLoadError(f"{spec}: model directory not found")
        return path
    family = spec[len("tiny:"):]
    target = cache_dir() / "tiny" / family
    with _making:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{family}-", dir=target.parent))
            try:
                make_tiny(family, tmp)
                try:
                    tmp.rename(target)
                except OSError:  # another process made it first
                    pass
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target
