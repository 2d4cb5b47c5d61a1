"""The frames a request is expected to make (routing's measure of load, engine/work.py). That the client's
account follows the core's progress is checked through a real server: tests/api/test_data_parallel.py."""

import dataclasses

from intone.engine.work import expected_frames
from intone.protocol import SamplingParams, SynthesisRequest

FPS = 44100 / 2048


def test_expected_frames_follow_the_text_within_the_request_bounds():
    english = SynthesisRequest("a", "x" * 28, params=SamplingParams(max_new_tokens=500))
    assert expected_frames(english, FPS) == 44  # 28 characters at 14 a second: 2 s of 21.5 frames
    chinese = dataclasses.replace(english, text="你好" * 9)  # 18 wide characters at 4.5 a second: 4 s
    assert expected_frames(chinese, FPS) == 87
    assert expected_frames(dataclasses.replace(english, params=SamplingParams(max_new_tokens=30)), FPS) == 30
    assert expected_frames(dataclasses.replace(english, params=SamplingParams(min_new_tokens=100)), FPS) == 100
    eos_ignored = dataclasses.replace(english, params=SamplingParams(max_new_tokens=700, ignore_eos=True))
    assert expected_frames(eos_ignored, FPS) == 700
