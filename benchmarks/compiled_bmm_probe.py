"""One MLP block whose three matmuls are ``bmm`` calls on bf16 weights passed as *inputs* (not frozen constants), compiled
by inductor with max-autotune (issue 57's second study): inductor's CPP template accepts a non-constant second operand
for ``bmm`` only. Prints the first call's time, times beside eager bf16 and float32, and the error against the
product of the rounded inputs with float32 outputs. ``dynamic=True`` here; with
``TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS=CPP`` it fails with "No choices exist" (the template refuses a symbolic
M), and with a static M (``sed s/dynamic=True/dynamic=False/``) the template runs but its error stays 9e-3.
Findings: benchmarks/ENGINE_NOTES.md.

    .venv/bin/python benchmarks/compiled_bmm_probe.py auto
"""
import time, sys, os, torch, torch.nn.functional as F, statistics
torch.set_num_threads(2); torch.manual_seed(0)
import torch._inductor.config as ic
bf = torch.bfloat16
K, N = 576, 1536
W = [(torch.randn(N, K) / 24), (torch.randn(N, K) / 24), (torch.randn(K, N) / 40)]
Wt = [w.to(bf).t().contiguous()[None] for w in W]  # [1, K, N] bf16
def mm(x, wt):  # x [M,K] fp32 -> fp32 unrounded hopefully
    return torch.bmm(x.to(bf)[None], wt)[0].float()
def mlp(h, g, u, d):
    return h + mm(F.silu(mm(h, g)) * mm(h, u), d)
def ref(h, g, u, d):
    r = lambda x, wt: x.to(bf).double() @ wt[0].double()
    a = F.silu(r(h, g).float()) * r(h, u).float()
    return h.double() + r(a, d)
def eager(h, g, u, d):
    e = lambda x, wt: torch.bmm(x.to(bf)[None], wt)[0].float()
    return h + e(F.silu(e(h, g)) * e(h, u), d)
W32 = [w.to(bf).float() for w in W]
def fp32(h):
    return h + F.linear(F.silu(F.linear(h, W32[0])) * F.linear(h, W32[1]), W32[2])
mode = sys.argv[1]
f = torch.compile(mlp, mode="max-autotune" if "auto" in mode else None, dynamic=True)
with torch.no_grad():
    for M_ in (287, 24, 64, 300):
        h = torch.randn(M_, K)
        t1 = time.perf_counter(); y = f(h, *Wt); c = time.perf_counter() - t1
        r = ref(h, *Wt); e = eager(h, *Wt)
        ts = {}
        for name, fn in (("comp", lambda: f(h, *Wt)), ("eager_bf16", lambda: eager(h, *Wt)), ("fp32", lambda: fp32(h))):
            rr = []
            for _ in range(20):
                t = time.perf_counter(); fn(); rr.append(time.perf_counter() - t)
            ts[name] = statistics.median(rr) * 1e3
        print(mode, M_, f"first {c:.1f}s", {k: round(v, 3) for k, v in ts.items()}, f"err comp {(y.double()-r).abs().max().item():.1e} eager {(e.double()-r).abs().max().item():.1e}", flush=True)
