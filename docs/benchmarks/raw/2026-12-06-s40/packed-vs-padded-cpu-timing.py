import torch, time, sys
sys.path.insert(0, "/work/main")
from intone.models.registry import load_model
from intone.models import resolve_model_dir
from intone.models.fish_s2.codec_stream import StreamingDecoder
from intone.models.fish_s2.codec_packed import PackedStreamingDecoder
torch.set_num_threads(4)
codec = load_model(str(resolve_model_dir("tiny:fish-s2")), dtype=torch.float32, codec_dtype=torch.float32).codec
lens = [25]*12 + [4]*4
codes = torch.randint(0, 1024, (len(lens), 10, 32))
for name, d in (("padded", StreamingDecoder(codec)), ("packed", PackedStreamingDecoder(codec))):
    d.decode(codes, lens, [None]*len(lens))
    t = time.perf_counter()
    for _ in range(5): d.decode(codes, lens, [None]*len(lens))
    print(name, f"{(time.perf_counter()-t)/5*1000:.1f} ms per call (16 rows: 12 x 25 + 4 x 4 frames; padded 16 x 32 = 512 frames, packed", (d.packed_length(lens) if hasattr(d, 'packed_length') else '-'), ")")
