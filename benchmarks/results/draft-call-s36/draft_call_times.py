import time, collections, torch
import speculant
from speculant.core import lean as leanmod
from speculant.drafters import model as dm
torch.set_num_threads(2)
s = speculant.load("qwen2.5-coder-1.5b-instruct")
acc = collections.defaultdict(lambda: [0, 0.0])
def wrap(cls, name, key):
    f = getattr(cls, name)
    def g(self, *a, **k):
        t = time.perf_counter(); r = f(self, *a, **k); el = time.perf_counter() - t
        T = a[0].shape[-1] if name == "hidden" else None
        kk = f"{key}{'' if T is None else (':T=1' if T == 1 else ':T>1')}"
        acc[kk][0] += 1; acc[kk][1] += el
        return r
    setattr(cls, name, g)
wrap(leanmod.LeanForward, "hidden", "lean.hidden")
from speculant.core import kernels as K
_f = K.q4_layers
def q4l(x, *a, **k):
    t = time.perf_counter(); r = _f(x, *a, **k); el = time.perf_counter() - t
    kk = "q4_layers:T=1" if x.shape[0] == 1 else "q4_layers:T>1"
    acc[kk][0] += 1; acc[kk][1] += el
    return r
leanmod.kernels.q4_layers = q4l
import speculant.core.lean as L2
wrap(L2.LeanForward, "logits", "lean.logits")
wrap(dm.DraftModelBase, "_head_logits", "draft.head")
wrap(dm.DraftModelBase, "_next_logits", "draft.next_logits")
wrap(dm.ChainDrafter if hasattr(dm, "ChainDrafter") else dm.DraftModelBase, "propose", "draft.propose")
prompt = "Write a Python function that parses an ISO 8601 date string into a datetime, with a docstring and type hints."
s.generate(prompt, max_new_tokens=16)
acc.clear()
t = time.perf_counter(); g = s.generate(prompt, max_new_tokens=128); el = time.perf_counter() - t
print(f"wall {el:.2f}s tokens {len(g.token_ids)} tau {g.stats.acceptance_length:.2f}")
for k, (n, tt) in sorted(acc.items()):
    print(f"{k:28s} n={n:4d} total {tt*1000:8.1f} ms  per call {tt/n*1000:6.2f} ms")
