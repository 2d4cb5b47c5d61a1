"""The torch ports of CosyVoice3's frontend networks against onnxruntime on the same files,
batching, per-clip errors, strict loading and the onnxruntime fallback."""

from __future__ import annotations

import logging
import math
import warnings

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from intone.errors import InvalidRequestError, ModelLoadError
from intone.models.cosyvoice3 import features as fx
from intone.models.cosyvoice3 import frontend as fe
from intone.models.cosyvoice3 import frontend_networks as networks
from intone.models.cosyvoice3 import tiny_onnx
from intone.models.cosyvoice3.campplus_net import CamShape, export_campplus, random_campplus
from intone.models.cosyvoice3.frontend import (
    ReferenceFeatures,
    ReferenceFrontend,
    SpeakerEncoder,
    SpeechTokenizer,
    extract_reference,
)
from intone.models.cosyvoice3.speech_tokenizer_net import (
    TokenizerShape,
    export_speech_tokenizer,
    random_speech_tokenizer,
)


def _speech(seconds: float, rate: int = 16000, seed: int = 0) -> torch.Tensor:
    """A voiced-sounding test clip: a gliding harmonic tone with noise, float32."""
    n = int(seconds * rate)
    t = torch.arange(n, dtype=torch.float64) / rate
    f0 = 140.0 + 40.0 * torch.sin(2 * math.pi * 0.7 * t)
    phase = 2 * math.pi * torch.cumsum(f0, 0) / rate
    tone = sum(0.3 / k * torch.sin(k * phase) for k in range(1, 6))
    g = torch.Generator().manual_seed(seed)
    return (tone + 0.02 * torch.randn(n, generator=g, dtype=torch.float64)).to(torch.float32)


CLIP_SECONDS = (0.06, 0.9, 2.3, 4.1)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("frontend-torch")
    return {"dir": root,
            "tokenizer": tiny_onnx.export_tiny_speech_tokenizer(root / "speech_tokenizer_v3.onnx", seed=3),
            "campplus": tiny_onnx.export_tiny_campplus(root / "campplus.onnx", seed=3)}


@pytest.fixture(scope="module")
def ports(files):
    return SpeechTokenizer(files["tokenizer"]).load(), SpeakerEncoder(files["campplus"]).load()


@pytest.fixture(scope="module")
def sessions(files):
    return (SpeechTokenizer(files["tokenizer"], backend="onnxruntime").load(),
            SpeakerEncoder(files["campplus"], backend="onnxruntime").load())


def _session_tokens(tokenizer: SpeechTokenizer, clips):
    return [tokenizer._session_tokens(fx.whisper_log_mel(c)) for c in clips]


def _session_vectors(encoder: SpeakerEncoder, clips):
    out = []
    for c in clips:
        f = fx.kaldi_fbank(c)
        out.append(encoder._session_vector(f - f.mean(0, keepdim=True)))
    return out


# --------------------------------------------------------------------------------------------
# the files: naming, backend choice


def test_tiny_files_carry_the_official_naming(files):
    tok = onnx.load(str(files["tokenizer"])).graph
    names = {i.name for i in tok.initializer}
    assert {"blocks.0.attn.fsmn_block.weight", "blocks.1.attn_ln.weight", "blocks.1.mlp_ln.bias",
            "quantizer.project_in.bias"} <= names
    generated = [n for n in names if n.startswith("onnx::")]
    assert sum(n.startswith("onnx::Conv_") for n in generated) == 4  # conv1/conv2 weight + bias
    assert sum(n.startswith("onnx::MatMul_") for n in generated) == 2 * 6 + 1  # 6 per block + quantizer
    assert sum(n.startswith("onnx::Add_") for n in generated) == 2 * 5  # block biases
    nodes = {n.name for n in tok.node}
    assert {"/blocks.1/attn/query/MatMul", "/blocks.1/attn/key/MatMul", "/blocks.0/mlp/mlp.2/Add",
            "/blocks.0/attn_ln/LayerNormalization", "/blocks.0/attn/fsmn_block/Conv"} <= nodes
    cam = onnx.load(str(files["campplus"])).graph
    names = {i.name for i in cam.initializer}
    assert {"xvector.block1.tdnnd1.nonlinear1.batchnorm.running_var",
            "xvector.block3.tdnnd2.cam_layer.linear_local.weight", "xvector.transit1.linear.weight",
            "xvector.dense.linear.weight", "xvector.dense.nonlinear.batchnorm.running_mean"} <= names
    assert not any("head." in n or "tdnn.linear" in n for n in names)  # conv + BN pairs are folded: onnx::Conv_*
    assert [i.name for i in cam.input] == ["input"] and [o.name for o in cam.output] == ["output"]


def test_tiny_files_load_into_the_torch_ports(ports, caplog):
    tokenizer, encoder = ports
    assert tokenizer.backend == "torch" and encoder.backend == "torch"
    assert tokenizer.net.shape == tiny_onnx.TINY_TOKENIZER
    assert encoder.net.shape == tiny_onnx.TINY_CAMPPLUS


def test_backend_is_logged(files, caplog):
    with caplog.at_level(logging.INFO, logger="intone.models.cosyvoice3.frontend_networks"):
        SpeechTokenizer(files["tokenizer"]).load()
        SpeakerEncoder(files["campplus"], backend="onnxruntime").load()
    text = caplog.text
    assert "speech tokenizer runs on the torch port" in text
    assert "speaker encoder (CAM++) runs on onnxruntime" in text


# --------------------------------------------------------------------------------------------
# torch port == onnxruntime on the same file


def test_tiny_tokenizer_port_equals_onnxruntime(ports, sessions):
    clips = [_speech(s, seed=i) for i, s in enumerate(CLIP_SECONDS + (11.0,))]
    ours = [ports[0](c) for c in clips]
    theirs = _session_tokens(sessions[0], clips)
    for a, b in zip(ours, theirs):
        assert a.dtype == torch.int64 and a.shape == b.shape
        assert int(a.min()) >= 0 and int(a.max()) < 6561
    agree = torch.cat([a == b for a, b in zip(ours, theirs)]).double().mean().item()
    assert agree >= 0.995  # measured: 1.0 (an FSQ rounding flip between runtimes is possible in principle)
    assert len(set(torch.cat(ours).tolist())) > 20


def test_tiny_campplus_port_equals_onnxruntime(ports, sessions):
    clips = [_speech(s, seed=i) for i, s in enumerate(CLIP_SECONDS + (11.0,))]
    for a, b in zip([ports[1](c) for c in clips], _session_vectors(sessions[1], clips)):
        assert a.shape == (192,) and a.dtype == torch.float32
        assert (a - b).abs().max().item() < 1e-4


# --------------------------------------------------------------------------------------------
# batching


def test_batch_equals_one_at_a_time(ports):
    tokenizer, encoder = ports
    clips = [_speech(s, seed=7 + i) for i, s in enumerate((3.2, 0.06, 1.7, 0.9, 3.0))]
    for batch, one in zip(tokenizer.tokenize_batch(clips), [tokenizer(c) for c in clips]):
        assert torch.equal(batch, one)
    for batch, one in zip(encoder.embed_batch(clips), [encoder(c) for c in clips]):
        assert (batch - one).abs().max().item() < 1e-5


def test_speaker_calls_of_several_rows_give_each_clip_what_it_gets_alone(files):
    """`cosyvoice3.speaker_rows`: clips of one length bucket share a CAM++ call of a fixed shape, and a
    clip's vector is the same bits among others as alone (the one-row default to rounding); the
    frontend still gives every clip its own features, once."""
    encoder = SpeakerEncoder(files["campplus"]).load()  # its own: set_batching changes it
    clips = [_speech(s, seed=20 + i) for i, s in enumerate((3.1, 3.6, 2.2, 3.9, 1.1, 3.3))]
    one_row = [encoder(c) for c in clips]
    encoder.set_batching(4, 2)
    assert encoder.embed_groups(clips) == [[0, 1, 2, 3], [4], [5]]
    together = encoder.embed_batch(clips)
    for i, clip in enumerate(clips):
        alone = encoder.embed_batch([clip])[0]
        assert torch.equal(together[i], alone), i
        assert (alone - one_row[i]).abs().max().item() < 1e-5
    tokenizer = SpeechTokenizer(files["tokenizer"]).load()
    done = dict(fe.extract_each([(c, 16000) for c in clips], tokenizer, encoder))
    assert sorted(done) == list(range(len(clips)))
    assert all(torch.equal(done[i].speaker, together[i]) for i in done)


def test_tokenizer_calls_of_fixed_rows_give_each_clip_its_tokens(files, cosy64):
    """`cosyvoice3.tokenizer_rows`: one clip a tokenizer call in 1 s buckets (no other clip's padding) or two a
    call in 2 s buckets, and each clip gets the tokens it gets in the default calls of similar lengths; the
    profile's section reaches the model's tokenizer."""
    from intone.engine.config import load_profile

    tokenizer = SpeechTokenizer(files["tokenizer"]).load()  # its own: set_batching changes it
    clips = [_speech(s, seed=40 + i) for i, s in enumerate((3.2, 0.4, 1.7, 2.9, 1.1))]
    default = tokenizer.tokenize_batch(clips)
    for rows, bucket in ((1, 1), (2, 2)):
        tokenizer.set_batching(rows, bucket)
        groups = tokenizer.call_groups([c.shape[-1] // 160 for c in clips])
        assert all(len(g) <= rows for g in groups) and sorted(i for g in groups for i in g) == list(range(5))
        assert all(torch.equal(a, b) for a, b in zip(tokenizer.tokenize_batch(clips), default))
    profile = load_profile("cosyvoice3-full-response", device="cpu", **{"cosyvoice3.tokenizer_rows": 1})
    before = cosy64.speech_tokenizer.fixed_rows, cosy64.speech_tokenizer.frame_bucket
    try:
        cosy64.configure_frontend(profile.options_for("cosyvoice3"))
        assert (cosy64.speech_tokenizer.fixed_rows, cosy64.speech_tokenizer.frame_bucket) == (1, networks.FRAME_BUCKET)
    finally:
        cosy64.speech_tokenizer.fixed_rows, cosy64.speech_tokenizer.frame_bucket = before


def test_a_long_bucket_takes_fewer_rows_per_call(files):
    """With many rows and a coarse bucket, a call still stays within MAX_BATCH_FRAMES padded frames
    (fewer rows for longer buckets: still one fixed shape per bucket)."""
    encoder = SpeakerEncoder(files["campplus"]).load()
    encoder.set_batching(32, 30)
    shapes, network = [], encoder._forward
    encoder._forward = lambda x, lengths: shapes.append(tuple(x.shape[:2])) or network(x, lengths)
    encoder.embed_batch([_speech(12.0, seed=3)])
    assert shapes == [(networks.MAX_BATCH_FRAMES // 3000, 3000)]


def test_extract_batch_gives_bad_clips_their_own_error(files, ports):
    frontend = ReferenceFrontend.from_models(*ports)
    good = [(_speech(1.3, 44100, seed=1), 44100), (_speech(2.1, seed=2), 16000),
            (torch.stack([_speech(0.7, 24000, seed=3), _speech(0.7, 24000, seed=4)]), 24000)]
    bad = [(torch.zeros(0), 16000), (torch.tensor([0.0, float("nan")] * 4000), 16000), (torch.zeros(4000), 8000),
           (torch.zeros(30 * 16000 + 1), 16000), (torch.zeros(100), 16000)]
    items = [good[0], bad[0], bad[1], good[1], bad[2], bad[3], good[2], bad[4]]
    out = frontend.extract_batch(items, field="voice")
    words = ["empty", "NaN", "16000 Hz", "30 s", "too short"]
    for result, w in zip([out[i] for i in (1, 2, 4, 5, 7)], words):
        assert isinstance(result, InvalidRequestError) and result.field == "voice" and w in result.message
    for result, (audio, rate) in zip([out[i] for i in (0, 3, 6)], good):
        alone = extract_reference(audio, rate, *ports)
        assert isinstance(result, ReferenceFeatures)
        assert torch.equal(result.speech_tokens, alone.speech_tokens)
        assert torch.equal(result.prompt_mel, alone.prompt_mel)
        assert (result.speaker - alone.speaker).abs().max().item() < 1e-5
        assert result.speaker.device.type == "cpu" and result.speech_tokens.device.type == "cpu"


def test_a_network_failure_fails_only_its_clip(ports, monkeypatch):
    tokenizer, encoder = ports
    clips = [(_speech(1.0, seed=1), 16000), (_speech(1.4, seed=2), 16000)]
    net_call = encoder.net.forward

    def fragile(feats, lengths=None):
        if feats.shape[1] > 130:  # the 1.4 s clip, alone or in a batch
            raise RuntimeError("boom")
        return net_call(feats, lengths)

    monkeypatch.setattr(encoder.net, "forward", fragile)
    out = fe.extract_batch(clips, tokenizer, encoder)
    assert isinstance(out[0], ReferenceFeatures)
    assert isinstance(out[1], RuntimeError) and "boom" in str(out[1])


# --------------------------------------------------------------------------------------------
# strict loading and the fallback


def _edited(src, dst, edit):
    model = onnx.load(str(src))
    edit(model.graph)
    onnx.save(model, str(dst))
    return dst


def _replace(graph, name, array):
    old = next(t for t in graph.initializer if t.name == name)
    graph.initializer.remove(old)
    graph.initializer.append(onnx.numpy_helper.from_array(array, name))


def test_mis_shaped_tensor_is_a_load_error_naming_file_and_tensor(files, tmp_path):
    bad = _edited(files["tokenizer"], tmp_path / "speech_tokenizer_v3.onnx",
                  lambda g: _replace(g, "blocks.1.attn.fsmn_block.weight", np.zeros((128, 1, 29), np.float32)))
    with pytest.raises(ModelLoadError, match=r"speech_tokenizer_v3\.onnx.*blocks\.1\.attn\.fsmn_block\.weight"):
        SpeechTokenizer(bad).load()
    name = "xvector.block2.tdnnd1.cam_layer.linear1.weight"
    bad = _edited(files["campplus"], tmp_path / "campplus.onnx",
                  lambda g: _replace(g, name, np.zeros((8, 15, 1), np.float32)))
    with pytest.raises(ModelLoadError, match=rf"campplus\.onnx.*{name}.*\(8, 15, 1\).*\(8, 16, 1\)"):
        SpeakerEncoder(bad).load()


def test_missing_tensor_is_a_load_error_naming_file_and_tensor(files, tmp_path):
    def drop(graph):
        graph.initializer.remove(next(t for t in graph.initializer if t.name == "blocks.0.attn_ln.bias"))

    bad = _edited(files["tokenizer"], tmp_path / "speech_tokenizer_v3.onnx", drop)
    with pytest.raises(ModelLoadError, match=r"speech_tokenizer_v3\.onnx.*'blocks\.0\.attn_ln\.bias'.*missing"):
        SpeechTokenizer(bad).load()


class _OtherTokenizer(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(128, 8, 4, stride=4)

    def forward(self, feats, feats_length):
        feats = feats * (feats_length > 0).to(feats.dtype)[:, None, None]
        digits = torch.round(torch.tanh(self.conv(feats)).transpose(1, 2)) + 1.0
        return (digits * 3.0 ** torch.arange(8.0)).sum(-1).to(torch.int32)


class _OtherEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(80, 192)

    def forward(self, x):
        return self.proj(x).mean(1)


def _export(module, args, path, inputs, outputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), args, str(path), input_names=inputs, output_names=outputs,
                          opset_version=17, dynamo=False,
                          dynamic_axes={inputs[0]: {0: "b", 1 if len(inputs) == 1 else 2: "t"}})
    return path


def test_another_network_runs_on_onnxruntime(tmp_path, caplog):
    tok = _export(_OtherTokenizer(), (torch.zeros(1, 128, 40), torch.tensor([40], dtype=torch.int32)),
                  tmp_path / "speech_tokenizer_v3.onnx", ["feats", "feats_length"], ["indices"])
    spk = _export(_OtherEncoder(), (torch.zeros(1, 50, 80),), tmp_path / "campplus.onnx", ["input"], ["output"])
    with caplog.at_level(logging.INFO, logger="intone.models.cosyvoice3.frontend_networks"):
        frontend = ReferenceFrontend(tmp_path).load()
    assert frontend.tokenizer.backend == "onnxruntime" and frontend.speaker_encoder.backend == "onnxruntime"
    assert "not the network of the torch port" in caplog.text
    ref = frontend(_speech(1.0), 16000)
    assert ref.num_tokens == 25 and ref.speaker.shape == (192,)
    with pytest.raises(ModelLoadError, match="campplus.onnx.*torch port cannot read"):
        SpeakerEncoder(spk, backend="torch").load()
    with pytest.raises(ModelLoadError, match="speech_tokenizer_v3.onnx.*torch port cannot read"):
        SpeechTokenizer(tok, backend="torch").load()


def test_a_port_that_disagrees_with_onnxruntime_is_not_used(files, monkeypatch, caplog):
    real = networks.speech_tokenizer_from_onnx

    def broken(graph):
        net = real(graph)
        with torch.no_grad():
            net.quantizer.project_in.weight.neg_()
        return net

    monkeypatch.setattr(networks, "speech_tokenizer_from_onnx", broken)
    with caplog.at_level(logging.WARNING, logger="intone.models.cosyvoice3.frontend_networks"):
        tokenizer = SpeechTokenizer(files["tokenizer"]).load()
    assert tokenizer.backend == "onnxruntime"
    assert "disagrees with onnxruntime" in caplog.text
    assert SpeechTokenizer(files["tokenizer"], verify=False).load().backend == "torch"


# --------------------------------------------------------------------------------------------
# real sizes


@pytest.mark.slow
def test_real_size_networks_match_onnxruntime(tmp_path):
    """Real-size random CAM++ (28 MB) and the tokenizer at its real widths (one of its 12 blocks)."""
    clip = _speech(2.0, seed=5)
    cam = export_campplus(random_campplus(CamShape(), seed=4, folded=False), tmp_path / "campplus.onnx")
    assert cam.stat().st_size > 25_000_000
    port, session = SpeakerEncoder(cam, verify=False).load(), SpeakerEncoder(cam, backend="onnxruntime").load()
    assert port.backend == "torch" and port.net.shape == CamShape()
    ours, theirs = port(clip), _session_vectors(session, [clip])[0]
    assert (ours - theirs).abs().max().item() < 1e-4
    tok = export_speech_tokenizer(random_speech_tokenizer(TokenizerShape(layers=1), seed=4),
                                  tmp_path / "speech_tokenizer_v3.onnx")
    port, session = SpeechTokenizer(tok, verify=False).load(), SpeechTokenizer(tok, backend="onnxruntime").load()
    assert port.net.shape == TokenizerShape(layers=1) and port.net.blocks[0].attn.heads == 20
    ours, theirs = port(clip), _session_tokens(session, [clip])[0]
    assert ours.shape == (50,) and (ours == theirs).double().mean().item() >= 0.98


@pytest.mark.slow
def test_random_frontend_is_real_size_and_runs():
    frontend = fe.random_frontend("cpu", seed=0)
    tok, spk = frontend.tokenizer.net, frontend.speaker_encoder.net
    assert tok.shape == TokenizerShape() and spk.shape == CamShape()
    assert frontend.tokenizer.backend == "torch" and frontend.device == torch.device("cpu")
    params = sum(p.numel() for p in tok.parameters())
    assert params > 230_000_000
    out = frontend.extract_batch([(_speech(0.3), 16000), (torch.zeros(0), 16000)])
    assert isinstance(out[0], ReferenceFeatures) and out[0].num_tokens == 7
    assert isinstance(out[1], InvalidRequestError)


# --------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
def test_batch_on_cuda_matches_cpu(files):
    cpu = ReferenceFrontend(files["dir"]).load()
    gpu = ReferenceFrontend(files["dir"]).load().to("cuda")
    assert gpu.device.type == "cuda" and next(gpu.tokenizer.net.parameters()).is_cuda
    items = [(_speech(s, 24000, seed=i), 24000) for i, s in enumerate((0.4, 2.5, 6.0, 1.1))]
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        on_gpu = gpu.extract_batch(items)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    for a, b in zip(on_gpu, cpu.extract_batch(items)):
        assert a.speech_tokens.device.type == "cpu"
        assert a.speech_tokens.shape == b.speech_tokens.shape
        assert (a.speech_tokens == b.speech_tokens).double().mean().item() >= 0.97
        assert (a.prompt_mel - b.prompt_mel).abs().max().item() < 1e-3
        assert (a.speaker - b.speaker).abs().max().item() < 1e-3


@pytest.mark.gpu
def test_frontend_graphs_give_the_eager_features_bitwise(files):
    """The start-up graphs of both networks replace their eager runs without changing a bit for a
    clip alone (CAM++ always runs so); a batch padded to a power of two keeps its tokens."""
    from intone.engine.cuda_graphs import FunctionGraphs
    from intone.models.cosyvoice3.frontend import warm_up

    eager = ReferenceFrontend(files["dir"]).load().to("cuda")
    graphed = ReferenceFrontend(files["dir"]).load().to("cuda")
    graphs = FunctionGraphs()
    warm_up(graphed.tokenizer, graphed.speaker_encoder, graphs)
    assert graphs.report.failed == 0 and len(graphs) > 10
    items = [(_speech(s, 24000, seed=i), 24000) for i, s in enumerate((2.37, 5.9, 3.3))]
    for batch in (items[:1], items):
        for a, b in zip(graphed.extract_batch(batch), eager.extract_batch(batch)):
            if len(batch) == 1:
                assert torch.equal(a.speech_tokens, b.speech_tokens)
            assert (a.speech_tokens == b.speech_tokens).double().mean().item() >= 0.97
            assert torch.equal(a.speaker, b.speaker)
            assert torch.equal(a.prompt_mel, b.prompt_mel)
    assert graphs.replays >= 6 and graphs.eager == 0


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True])
def test_a_shared_campplus_call_gives_a_clip_its_alone_bits_in_every_row_on_the_gpu(graphed):
    """`cosyvoice3.speaker_rows` > 1 on the GPU: real-size CAM++, a clip in each of the four rows of a
    shared call, each time with other company, has the bits it has alone (kernels whose rounding
    depended on a row's place in the batch would break the promise that a request's audio does not
    depend on which references arrived with it)."""
    from intone.engine.cuda_graphs import FunctionGraphs
    from intone.models.cosyvoice3.frontend import warm_up

    encoder = SpeakerEncoder.from_net(random_campplus(CamShape(), seed=5, device="cuda"))
    tokenizer = fe.random_frontend("cuda").tokenizer
    encoder.set_batching(4, 2)
    if graphed:
        graphs = FunctionGraphs()
        warm_up(tokenizer, encoder, graphs)
    target = _speech(3.3, seed=40).cuda()
    alone = encoder.embed_batch([target])[0]
    others = [_speech(s, seed=41 + i).cuda() for i, s in enumerate((3.1, 3.9, 2.6, 3.5, 2.2, 3.7))]
    for row in range(4):
        company = [others[(2 * row + j) % 6] for j in range(3)]
        batch = company[:row] + [target] + company[row:]
        assert encoder.embed_groups(batch) == [[0, 1, 2, 3]]
        assert torch.equal(encoder.embed_batch(batch)[row], alone), row
