"""Local reference audio stays inside the allowed media directory, whatever the path says.

Every escape points at a REAL readable wav outside the directory, so a check that only compared
path strings (or forgot to resolve symlinks and `..`) would load it instead of refusing it."""

import asyncio
import os
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest
import soundfile as sf

from intone.api.media import MediaPolicy, load_reference
from intone.errors import InvalidRequestError, MediaTooLarge

FIELDS = ["ref_audio", "references.1.audio_path"]
RATE, SAMPLES = 16000, 1600


def write_wav(path: Path, value: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, np.full(SAMPLES, value, dtype=np.float32), RATE, subtype="FLOAT")
    return path


@pytest.fixture
def tree(tmp_path):
    """x/media (allowed: ref.wav, sub/, links), x/outside/ref.wav, x/media-evil/a.wav (shares the prefix)."""
    x = tmp_path / "x"
    media = x / "media"
    write_wav(media / "ref.wav", 0.25)
    write_wav(media / "sub" / "deep.wav", 0.5)
    outside = write_wav(x / "outside" / "ref.wav", -0.75)
    evil = write_wav(x / "media-evil" / "a.wav", -0.5)
    (media / "link.wav").symlink_to(outside)
    (media / "linkdir").symlink_to(outside.parent, target_is_directory=True)
    (media / "inner-link.wav").symlink_to(media / "sub" / "deep.wav")
    (media / "rel-link.wav").symlink_to(Path("..") / "outside" / "ref.wav")
    return {"x": x, "media": media, "outside": outside, "evil": evil}


def load(source, field, policy):
    return asyncio.run(load_reference(source, "the transcript", field, policy))


def escapes(t):
    media, outside, evil = t["media"], t["outside"], t["evil"]
    return {
        "dotdot": "../outside/ref.wav",
        "dotdot-via-sub": "sub/../../outside/ref.wav",
        "dotdot-from-dot": "./../outside/ref.wav",
        "absolute": str(outside),
        "absolute-through-media-dotdot": f"{media}/../outside/ref.wav",
        "symlink-to-a-file-outside": "link.wav",
        "symlink-with-a-relative-target": "rel-link.wav",
        "absolute-symlink-path": str(media / "link.wav"),
        "symlinked-directory": "linkdir/ref.wav",
        "sibling-sharing-the-prefix-absolute": str(evil),
        "sibling-sharing-the-prefix-relative": "../media-evil/a.wav",
        "file-absolute": f"file://{outside}",
        "file-localhost-absolute": f"file://localhost{outside}",
        "file-sibling-prefix": f"file://{evil}",
        "file-%2e%2e": f"file://{media}/%2e%2e/outside/ref.wav",
        "file-%2E%2E-upper": f"file://{media}/%2E%2E/outside/ref.wav",
        "file-encoded-slashes": f"file://{media}/..%2Foutside%2Fref.wav",
        "file-fully-encoded": "file:///" + quote(str(outside)[1:], safe=""),
        "file-relative-%2e%2e": "file:%2e%2e/outside/ref.wav",
        "file-symlink": f"file://{media}/link.wav",
        "plain-%2e%2e-not-decoded": "%2e%2e/outside/ref.wav",
        "plain-%2e%2e-absolute": f"{media}/%2e%2e/outside/ref.wav",
    }


def insides(t):
    media = t["media"]
    return {
        "relative": ("ref.wav", 0.25),
        "relative-in-a-subdirectory": ("sub/deep.wav", 0.5),
        "dotdot-that-stays-inside": ("sub/../ref.wav", 0.25),
        "absolute": (str(media / "ref.wav"), 0.25),
        "absolute-with-dotdot-inside": (f"{media}/sub/../ref.wav", 0.25),
        "symlink-to-a-file-inside": ("inner-link.wav", 0.5),
        "file-absolute": (f"file://{media}/ref.wav", 0.25),
        "file-%2e%2e-inside": (f"file://{media}/sub/%2e%2e/ref.wav", 0.25),
        "file-encoded-name": (f"file://{media}/sub/%64eep.wav", 0.5),
    }


ESCAPES = list(escapes({"media": Path("/m"), "outside": Path("/o"), "evil": Path("/e")}))
INSIDES = list(insides({"media": Path("/m")}))
# Plain paths are not percent-decoded: these name a missing file inside and are refused as such. Every
# other escape names an existing file outside and must be refused *as outside*, not as missing.
NOT_DECODED = {"plain-%2e%2e-not-decoded", "plain-%2e%2e-absolute"}


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("case", ESCAPES)
def test_escapes_are_refused_naming_the_field(tree, case, field):
    source = escapes(tree)[case]
    with pytest.raises(InvalidRequestError) as e:
        load(source, field, MediaPolicy(allowed_local_dir=tree["media"]))
    assert type(e.value) is InvalidRequestError and e.value.field == field
    if case not in NOT_DECODED:
        assert "outside the allowed media directory" in e.value.message, e.value.message


def test_the_escape_targets_are_real_audio(tree):
    """So the refusals above are about the directory, not a missing or unreadable file."""
    policy = MediaPolicy(allowed_local_dir=tree["x"])
    for source, value in [(str(tree["outside"]), -0.75), (str(tree["evil"]), -0.5), ("media/link.wav", -0.75),
                          ("media/linkdir/ref.wav", -0.75), ("media/rel-link.wav", -0.75)]:
        ref = load(source, "ref_audio", policy)
        assert float(ref.audio[0]) == value and ref.sample_rate == RATE


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("case", INSIDES)
def test_the_same_kinds_of_path_inside_the_directory_load(tree, case, field):
    source, value = insides(tree)[case]
    ref = load(source, field, MediaPolicy(allowed_local_dir=tree["media"]))
    assert ref.sample_rate == RATE and ref.audio.shape == (SAMPLES,) and float(ref.audio[0]) == value
    assert ref.text == "the transcript"


@pytest.mark.parametrize("case", INSIDES)
def test_an_allowed_directory_given_through_a_symlink_works_the_same(tree, case):
    alias = tree["x"] / "media-alias"
    alias.symlink_to(tree["media"], target_is_directory=True)
    source, value = insides(tree)[case]
    assert float(load(source, "ref_audio", MediaPolicy(allowed_local_dir=alias)).audio[0]) == value
    with pytest.raises(InvalidRequestError, match="outside"):
        load("../outside/ref.wav", "ref_audio", MediaPolicy(allowed_local_dir=alias))


def test_a_relative_allowed_directory_is_taken_from_the_working_directory(tree, monkeypatch):
    monkeypatch.chdir(tree["x"])
    policy = MediaPolicy(allowed_local_dir=Path("media"))
    assert float(load("ref.wav", "ref_audio", policy).audio[0]) == 0.25
    assert float(load(str(tree["media"] / "sub" / "deep.wav"), "ref_audio", policy).audio[0]) == 0.5
    for source in ("../outside/ref.wav", "link.wav", str(tree["evil"])):
        with pytest.raises(InvalidRequestError, match="outside"):
            load(source, "ref_audio", policy)


def test_the_allowed_directory_itself_and_its_parent_are_not_files(tree):
    policy = MediaPolicy(allowed_local_dir=tree["media"])
    for source in (".", str(tree["media"]), "..", "sub", f"file://{tree['media']}"):
        with pytest.raises(InvalidRequestError) as e:
            load(source, "ref_audio", policy)
        assert e.value.field == "ref_audio"


def test_local_files_are_refused_when_no_directory_is_allowed(tree):
    for source in ("ref.wav", str(tree["media"] / "ref.wav"), f"file://{tree['media']}/ref.wav"):
        with pytest.raises(InvalidRequestError, match="disabled") as e:
            load(source, "references.1.audio_path", MediaPolicy())
        assert e.value.field == "references.1.audio_path"


def test_the_size_limit_is_checked_on_the_resolved_file(tree):
    size = os.path.getsize(tree["media"] / "sub" / "deep.wav")
    policy = MediaPolicy(allowed_local_dir=tree["media"], max_bytes=size - 1)
    with pytest.raises(MediaTooLarge) as e:
        load("inner-link.wav", "ref_audio", policy)  # the link is tiny; its target is not
    assert e.value.field == "ref_audio"
    ok = MediaPolicy(allowed_local_dir=tree["media"], max_bytes=size)  # exactly at the limit: allowed
    assert float(load("inner-link.wav", "ref_audio", ok).audio[0]) == 0.5
