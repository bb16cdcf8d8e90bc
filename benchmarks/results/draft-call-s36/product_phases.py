import time, ctypes, torch
from speculant.core import kernels
from speculant.core.cache import SpecCache
from speculant.core.checks import num_layers
from speculant.core.forward import lean_for
from speculant.models.loading import load_pretrained
import sys
torch.set_num_threads(2)
lib = kernels.build_of("/tmp/kb/inst")
name, quant = sys.argv[1], sys.argv[2]
model = load_pretrained(name, dtype="float32", quantization=quant)[0]
lean = lean_for(model)
cache = SpecCache(num_layers(model), capacity=600)
out = (ctypes.c_double * 32)()
with kernels.using(lib), torch.inference_mode():
    lean.hidden(torch.randint(100, 1000, (1, 200)), cache)
    for T in (1, 4):
        ids = torch.randint(100, 1000, (1, T))
        for _ in range(10): lean.hidden(ids, cache); cache.crop(200)
        lib.inst_reset()
        n = 100
        t = time.perf_counter()
        for _ in range(n): lean.hidden(ids, cache); cache.crop(200)
        el = (time.perf_counter() - t) / n
        lib.inst_get(out)
        v = [x / n * 1000 for x in out]
        print(f"T={T} per call {el*1000:.2f} ms; per thread (ms): prologue / wait / columns / wait-end")
        for th in range(2):
            print("  thread", th, " ".join(f"{x:.3f}" for x in v[4*th:4*th+4]), " sum", f"{sum(v[4*th:4*th+4]):.3f}")
