"""The codec stage: grouping bounds, and batched decoding equal to decoding each window alone."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from intone.engine.codec_stage import CodecJob, CodecStage
from intone.ops.batching import group_jobs


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 120), min_size=1, max_size=40), st.integers(1, 16), st.integers(1, 400))
def test_groups_cover_every_job_once_within_bounds(lengths, max_batch, max_padded):
    groups = group_jobs(lengths, max_batch, max_padded)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) <= max_batch
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= max_padded


def test_batched_windows_equal_windows_decoded_alone(tiny_fish_dir):
    from intone.models.registry import load_model

    model = load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    jobs = [CodecJob(torch.randint(0, 4096, (10, n), generator=g), ctx, first)
            for n, ctx, first in [(29, 25, 4), (4, 0, 0), (50, 25, 29), (7, 7, 100), (31, 25, 200)]]
    stage = CodecStage(model, max_batch=8, max_padded_frames=256)
    batched = stage.decode(jobs)
    assert stage.calls == 1  # one call, four real windows (one is context only)
    for job, audio in zip(jobs, batched):
        if job.length == job.context:
            assert audio.shape == (0,)
            continue
        alone = model.decode(job.codes[None], job.first_frame)[0, job.context * 2048 :]
        assert audio.shape[0] == (job.length - job.context) * 2048
        assert (torch.from_numpy(audio).double() - alone).abs().max() < 1e-7
