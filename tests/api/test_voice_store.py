"""Two servers sharing one voices directory (Ray Serve replicas on a shared filesystem): what one
deletes or replaces, the other does not serve from its memory."""

import numpy as np
import pytest

from intone.api.voices import UnknownVoice, VoiceStore


def test_a_voice_deleted_or_replaced_by_another_store_is_not_served_from_memory(tmp_path):
    a, b = VoiceStore(tmp_path), VoiceStore(tmp_path)
    audio = np.zeros(1600, np.float32)
    a.add("v", "first", audio, 16000, {"codes": np.zeros((2, 5), np.int64)})
    assert b.reference("v").text == "first"  # now in b's memory
    a.delete("v")
    with pytest.raises(UnknownVoice):
        b.reference("v")
    a.add("v", "second", audio, 16000, {"codes": np.ones((2, 7), np.int64)})
    ref = b.reference("v")
    assert ref.text == "second" and ref.codes.shape == (2, 7)
    assert b.reference("v") is ref  # unchanged on disk: served from memory
