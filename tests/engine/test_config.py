"""Deploy profiles: the shipped files load; bad values are refused with the field named."""

import os

import pytest

from intone.engine.config import PROFILE_DIR, ProfileError, load_profile
from intone.engine.loading import load_for_profile
from intone.ops import paged_decode


@pytest.mark.parametrize("path", sorted(PROFILE_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_profiles_load(path):
    assert load_profile(str(path)).name == path.stem


def test_high_concurrency_reference_values():
    p = load_profile("fish-s2-high-concurrency")
    assert (p.ar.max_num_seqs, p.codec.max_batch, p.codec.dtype) == (64, 64, "float16")
    policy = p.chunking.policy(p.ar.max_num_seqs, 2048 / 44100)  # Fish: a frame of 2048 samples at 44.1 kHz
    assert (policy.initial_chunk_frames, policy.steady_chunk_frames, policy.backlog_chunk_frames) == (4, 25, 50)
    assert (policy.backlog_load_threshold, policy.left_context_frames, policy.backlog_min_ready) == (0.75, 25, 48)


@pytest.mark.parametrize("text, field", [
    ("ar: {max_num_seqs: 0}", "ar.max_num_seqs"),
    ("chunking: {steady_chunk_frames: 10, initial_chunk_frames: 20}", "initial_chunk_frames"),
    ("codec: {dtype: int8}", "codec.dtype"),
    ("codec: {device: 'cuda:1'}", "codec.device needs codec.process"),
    ("chunking: {whole_chunk_frames: 50}", "chunking.whole_chunk_frames needs codec.carry_state"),
    ("chunking: {listener_margin_s: 0.5}", "chunking.listener_margin_s needs codec.carry_state"),
    ("chunking: {backlog_load_threshold: 1.5}", "chunking.backlog_load_threshold"),
    ("chunking: {ramp_factor: 1.5, growth_factor: 2}", "ramp_factor"),
    ("codec: {row_granule: 65}", "codec.row_granule"),
    ("codec: {exact_rows: -1}", "codec.exact_rows"),
    ("codec: {packed_decode: true}", "codec.packed_decode needs codec.carry_state"),
    ("codec: {carry_state: true, packed_decode: true, lean_decode: true}", "codec.packed_decode runs eagerly"),
    ("{codec: {carry_state: true, lean_decode: true}, fish_s2: {decoder_layout: time_major}}",
     "fish_s2.decoder_layout"),
    ("codec: {high_priority: true, overlap: false}", "codec.high_priority"),
    ("codec: {high_priority: true, stream: loop}", "codec.high_priority"),
    ("codec: {frame_buckets: [25, 0]}", "codec.frame_buckets"),
    ("codec: {frame_buckets: 25}", "codec.frame_buckets"),
    ("ar: {prompt_row_buckets: [640, 4096]}", "ar.prompt_row_buckets.1"),
    ("ar: {prompt_row_buckets: 640}", "ar.prompt_row_buckets"),
    ("nonsense: 1", "nonsense"),
    ("- a list", "mapping"),
    ("ar: {max_num_seqs: [", "not valid YAML"),
])
def test_bad_profiles_name_the_field(tmp_path, text, field):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=field.replace(".", r"\.")):
        load_profile(str(path))


def test_missing_profile():
    with pytest.raises(ProfileError, match="not found"):
        load_profile("no-such-profile")


def test_host_switch_interval_is_set_in_the_process_that_loads_the_model(tiny_cache):
    import sys

    from intone.engine.loading import load_for_profile

    before = sys.getswitchinterval()
    try:
        load_for_profile("tiny:fish-s2", load_profile("fish-s2-default", device="cpu", host_switch_interval_ms=0.5))
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)
    with pytest.raises(ProfileError, match="host_switch_interval_ms"):
        load_profile("fish-s2-default", host_switch_interval_ms=0)


def test_decode_splits_are_a_power_of_two_up_to_16():
    assert load_profile("fish-s2-default", device="cpu", **{"ar.decode_splits": 4}).ar.decode_splits == 4
    with pytest.raises(ValueError, match="decode splits"):
        paged_decode.use_splits(3)  # the kernel's own check, for callers that bypass the profile
    for bad in (3, 32, 0):
        with pytest.raises(ProfileError, match="decode_splits"):
            load_profile("fish-s2-default", device="cpu", **{"ar.decode_splits": bad})


@pytest.mark.parametrize("other", [{"codec.process": True}, {"codec.overlap": False}])
def test_an_sm_share_needs_the_in_process_codec_worker(other):
    with pytest.raises(ProfileError, match="codec.sms"):
        load_profile("cosyvoice3-streaming", device="cpu", **{"codec.sms": 96, **other})


@pytest.mark.parametrize("other", [{"codec.process": True}, {"codec.overlap": False}, {"codec.sms": 64}])
def test_the_loops_stream_is_for_the_in_process_codec_worker(other):
    assert load_profile("fish-s2-default", device="cpu", **{"codec.stream": "loop"}).codec.stream == "loop"
    with pytest.raises(ProfileError, match="codec.stream"):
        load_profile("fish-s2-default", device="cpu", **{"codec.stream": "loop", **other})


def test_flex_flow_attention_goes_with_codec_graphs_but_the_flow_cache_only_with_varlen():
    uncached = {"cosyvoice3.flow.attention": "flex", "cosyvoice3.flow.cache": False}
    flow = load_profile("cosyvoice3-streaming", device="cpu",
                        **{"cosyvoice3.flow.cuda_graphs": True, **uncached}).cosyvoice3.flow
    assert flow.attention == "flex" and flow.cuda_graphs
    with pytest.raises(ProfileError, match="cosyvoice3.flow.cache"):  # the shipped profile keeps a flow cache
        load_profile("cosyvoice3-streaming", device="cpu",
                     **{"cosyvoice3.flow.cuda_graphs": True, "cosyvoice3.flow.attention": "flex"})
    # varlen (shipped): the graphs take the whole rows, the cache the continued hops
    flow = load_profile("cosyvoice3-streaming", device="cpu", **{"cosyvoice3.flow.cuda_graphs": True}).cosyvoice3.flow
    assert flow.cache and flow.cuda_graphs and flow.attention == "varlen"


@pytest.mark.parametrize("padded", ["cosyvoice3.flow.cuda_graphs", "cosyvoice3.flow.cache"])
def test_packed_flow_rows_are_refused_with_the_solves_that_stay_padded(padded):
    plain = {"cosyvoice3.flow.packed": True, "cosyvoice3.flow.cache": False, "cosyvoice3.flow.attention": "flex"}
    assert load_profile("cosyvoice3-streaming", device="cpu", **plain).cosyvoice3.flow.packed
    with pytest.raises(ProfileError, match="cosyvoice3.flow.packed"):
        load_profile("cosyvoice3-streaming", device="cpu", **{**plain, padded: True})


def test_a_familys_knobs_live_in_its_section_and_another_familys_profile_is_refused():
    """CosyVoice3's flow knobs are under `cosyvoice3:`, Fish's reference batching under `fish_s2:`; a key that
    moved names its new place, and a profile that sets a section is refused for the other family's model
    before anything loads."""
    assert load_profile("cosyvoice3-streaming").options_for("cosyvoice3").flow.attention == "varlen"
    assert load_profile("fish-s2-high-concurrency").options_for("fish-s2").reference_rows == 16
    assert load_profile("fish-s2-default").options_for("some-other-family") is None
    with pytest.raises(ProfileError, match="codec.flow_cache is now cosyvoice3.flow.cache"):
        load_profile("cosyvoice3-streaming", **{"codec.flow_cache": True})
    fishy = load_profile("fish-s2-default", **{"cosyvoice3.flow.cache": True})
    with pytest.raises(ProfileError, match="section cosyvoice3 is for cosyvoice3 models, not fish-s2"):
        load_for_profile("tiny:fish-s2", fishy)


def test_cuda_connections_reach_the_environment_before_the_context_and_stay_in_bounds():
    """An engine process given `cuda_connections` sets CUDA_DEVICE_MAX_CONNECTIONS before its CUDA context
    exists (a fresh interpreter, as a spawned engine is); the profile refuses what CUDA does not take."""
    import subprocess
    import sys

    code = ("import os; from intone.engine.loading import set_cuda_connections as s; s(None); "
            "print(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')); s(32); print(os.environ['CUDA_DEVICE_MAX_CONNECTIONS'])")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["None", "32"]
    assert load_profile("cosyvoice3-full-response", cuda_connections=16).cuda_connections == 16
    with pytest.raises(ProfileError, match="cuda_connections"):
        load_profile("cosyvoice3-full-response", cuda_connections=33)
