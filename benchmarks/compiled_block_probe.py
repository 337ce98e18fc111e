"""One Llama MLP block (gate, up, SiLU, down, the residual add) with bf16 weights, compiled by inductor, against the
same block in eager bf16 and in float32 (issue 57's second study): the first call's time (compile and autotune) and
the largest error against the product of the bf16-rounded inputs with float32 outputs. Random weights of SmolLM2's
shapes, 2 threads. ``dyn_auto``: ``mode="max-autotune", dynamic=True`` on a function taking the weights;
``freeze_mod_dyn_auto``: the same on a module, with ``inductor.config.freezing = True`` (the weights constants, the
CPP GEMM template's condition). Findings: benchmarks/ENGINE_NOTES.md (2026-12-07 (later), "The two kernels").

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/compiled_block_probe.py freeze_mod_dyn_auto
"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2); torch.manual_seed(0)
import torch._inductor.config as ic

bf = torch.bfloat16
mode = sys.argv[1]
if "freeze" in mode: ic.freezing = True
K, N = 576, 1536
wg, wu, wd = (torch.randn(N, K) / 24).to(bf), (torch.randn(N, K) / 24).to(bf), (torch.randn(K, N) / 40).to(bf)
def mlp(h, wg, wu, wd):
    x = h.to(bf)
    g = F.linear(x, wg).float(); u = F.linear(x, wu).float()
    a = (F.silu(g) * u)
    return h + F.linear(a.to(bf), wd).float()
def mlp32(h, wg, wu, wd):
    x = h.to(bf).float(); g = F.linear(x, wg.float()); u = F.linear(x, wu.float())
    a = (F.silu(g) * u).to(bf).float()
    return h + F.linear(a, wd.float())
class M(torch.nn.Module):
    def __init__(s): super().__init__(); s.wg, s.wu, s.wd = [torch.nn.Parameter(w, requires_grad=False) for w in (wg, wu, wd)]
    def forward(s, h): return mlp(h, s.wg, s.wu, s.wd)
m = M().eval()
kw = dict(mode="max-autotune" if "auto" in mode else None, dynamic=("dyn" in mode) or None)
t0 = time.perf_counter()
if "mod" in mode:
    f = torch.compile(m, **kw); call = lambda h: f(h)
else:
    f = torch.compile(mlp, **kw); call = lambda h: f(h, wg, wu, wd)
with torch.no_grad():
    for M_ in (287, 64, 300, 512):
        h = torch.randn(M_, K)
        t1 = time.perf_counter(); y = call(h); c = time.perf_counter() - t1
        ref = mlp32(h, wg, wu, wd); eag = mlp(h, wg, wu, wd)
        ts = {}
        for name, fn in (("comp", lambda: call(h)), ("eager_bf16", lambda: mlp(h, wg, wu, wd)), ("fp32", lambda: mlp32(h, wg.float(), wu.float(), wd.float()))):
            r = []
            for _ in range(15):
                t = time.perf_counter(); fn(); r.append(time.perf_counter() - t)
            ts[name] = statistics.median(r) * 1e3
        print(mode, M_, f"first call {c:.1f}s", {k: round(v, 2) for k, v in ts.items()}, "err comp", f"{(y-ref).abs().max().item():.2e}", "err eager", f"{(eag-ref).abs().max().item():.2e}", flush=True)
