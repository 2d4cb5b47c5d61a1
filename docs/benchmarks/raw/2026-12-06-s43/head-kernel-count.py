# Session 43: session 41's head-kernel-count.py with the filtered race counted as one kernel (and its logsumexp).
# Note: KERNEL:race is also counted inside it (a double count of 11). Run: PYTHONPATH=src python this.py
import torch, collections
from torch.utils._python_dispatch import TorchDispatchMode
from intone.models.registry import load_model
from intone.ops.sampling import SamplingBatch
from intone.ops.token_history import CAPACITY
from intone.ops import fused, sampling as smp, race as rk
VIEWS = {"view","reshape","transpose","unsqueeze","squeeze","select","slice","unflatten","flatten","expand","t","split","split_with_sizes","permute","alias","detach","_unsafe_view","as_strided","chunk","unbind","lift_fresh","promote_types","result_type","_to_copy_noop"}
class Count(TorchDispatchMode):
    def __init__(s): super().__init__(); s.c=collections.Counter(); s.mute=0
    def __torch_dispatch__(s, f, types, args=(), kwargs=None):
        n=str(f.overloadpacket).split('.')[-1]
        if not s.mute and n not in VIEWS:
            # .to to same dtype is a no-op alias
            s.c[n]+=1
        return f(*args, **(kwargs or {}))
C = Count()
def opaque(name, fn):
    def w(*a, **k):
        C.c["FUSED:"+name]+=1; C.mute+=1
        try: return fn(*a, **k)
        finally: C.mute-=1
    return w
for name, fn in list(fused._active.items()):
    fused._active[name] = opaque(name, fn)
# GPU race: one kernel
def race_gpu(probs, idx, params, draw):
    C.c["KERNEL:race"]+=1; C.mute+=1
    try:
        u = smp.request_uniforms(params.seeds, params.steps, draw, idx)
        return idx.gather(1, (probs / (-torch.log(u)).to(probs.dtype)).argmax(-1, keepdim=True)).squeeze(1)
    finally: C.mute-=1
smp.race = race_gpu
_fr = smp.filtered_race
def fr_gpu(logits, idx, params, draw):
    C.c["KERNEL:filtered_race"]+=1; C.c["logsumexp"]+=1; C.mute+=1
    try: return _fr(logits, idx, params, draw)
    finally: C.mute-=1
smp.filtered_race = fr_gpu
m = load_model("tiny:fish-s2")
rows=8; ones=torch.ones(rows)
sampling = SamplingBatch(temperature=0.8*ones, top_p=0.8*ones, top_k=torch.full((rows,),30), repetition_penalty=ones, seeds=torch.arange(rows), steps=torch.full((rows,),5), max_top_k=30, has_penalty=False, ban_stop=ones.bool()&False, below_min=ones.bool()&False, ras=ones.bool())
hidden = torch.randn(rows, m.cfg.text_dim)
hist = torch.full((rows, CAPACITY), -1, dtype=torch.long)
import intone.models.fish_s2.model as fm
fm.race = race_gpu
per = collections.Counter()
def wrap(obj, name, key):
    orig = getattr(obj, name)
    def w(*a, **k):
        before = sum(C.c.values())
        r = orig(*a, **k)
        per[key] += sum(C.c.values()) - before; per[key+"#"] += 1
        return r
    setattr(obj, name, w)
wrap(fm, "sample", "sample"); wrap(m.lm, "fast_step", "fast_step"); wrap(fm, "best_tokens", "best_tokens")
layer = m.lm.audio_decoder.layers[0]
wrap(layer, "forward", "fast_layer0")
with torch.inference_mode(), C:
    m.head(hidden, sampling, hist, 64)
print("head total", sum(C.c.values()), dict(per))
print(C.c.most_common(50))
