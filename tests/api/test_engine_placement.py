"""Where `--data-parallel N --devices LIST` puts each engine core (no GPU here: the environment each core's
process is given is what decides its GPU)."""

import os

import pytest

from intone.api.engine_pool import parse_device, place_engines


def test_each_core_sees_only_its_gpu_cycling_through_the_list():
    places = place_engines(4, ["0", "1"], {"PATH": "/bin"}, "auto")
    assert [(p.label, p.device, p.env["CUDA_VISIBLE_DEVICES"]) for p in places] == [
        ("cuda:0", "cuda", "0"), ("cuda:1", "cuda", "1"), ("cuda:0", "cuda", "0"), ("cuda:1", "cuda", "1")]
    assert all(p.env["PATH"] == "/bin" and "OMP_NUM_THREADS" not in p.env for p in places)


def test_indices_are_into_the_servers_own_visible_devices():
    places = place_engines(2, ["0", "1"], {"CUDA_VISIBLE_DEVICES": "2,3"}, "auto")
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in places] == ["2", "3"]


def test_without_devices_every_core_takes_the_profiles_device_and_cpu_cores_share_the_threads():
    places = place_engines(2, None, {}, "cpu")
    assert [(p.label, p.device) for p in places] == [("cpu", None), ("cpu", None)]
    assert [p.env["OMP_NUM_THREADS"] for p in places] == [str(max(1, os.cpu_count() // 2))] * 2
    assert "OMP_NUM_THREADS" not in place_engines(2, None, {}, "cuda")[0].env
    assert place_engines(2, ["cpu"], {"OMP_NUM_THREADS": "3"}, "auto")[1].env["OMP_NUM_THREADS"] == "3"  # theirs


def test_device_names():
    assert [parse_device(d) for d in ("cpu", " 1", "cuda:2", "CUDA:3")] == ["cpu", "1", "2", "3"]
    for bad in ("gpu", "cuda:", "-1", ""):
        with pytest.raises(ValueError):
            parse_device(bad)
