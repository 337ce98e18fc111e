"""Which CPU matmuls take bf16 inputs and give a float32 output that is not rounded to bf16 (issue 57's probe,
torch 2.13, one thread). Prints, per shape of the engine (M tokens x K=576 -> N=1536 or 576), each option's error
against the float32 product and against the exact product of the bf16-rounded inputs, and its time as a ratio to
eager float32 and eager bf16 measured side by side. Findings: benchmarks/ENGINE_NOTES.md (2026-12-07, the probe).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bf16_matmul_probe.py eager        # oneDNN fpmath, no compile
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bf16_matmul_probe.py freeze_autotune
"""
import sys, time, statistics, os, torch, torch.nn.functional as F
torch.set_num_threads(1)
torch.manual_seed(0)
import torch._inductor.config as ic
variant = sys.argv[1] if len(sys.argv) > 1 else "eager"
SHAPES = [(64,576,1536),(256,576,1536),(512,576,1536),(64,576,576),(512,576,576)]

def err(y, ref):
    d = (y.double()-ref).abs()
    return d.max().item(), (d.max()/ref.abs().max()).item()

class Lin(torch.nn.Module):
    def __init__(self, wb): super().__init__(); self.w = torch.nn.Parameter(wb, requires_grad=False)
    def forward(self, x): return F.linear(x.to(torch.bfloat16), self.w).float()

def fbf(x, wb): return F.linear(x.to(torch.bfloat16), wb).float()

def make_candidates(x, w, wb):
    w32b = wb.float()  # bf16-rounded weights held in fp32
    c = {}
    c["fp32_eager"] = lambda: F.linear(x, w)
    c["bf16_eager_raw(xb,wb)->bf16"] = (lambda xb=x.bfloat16(): F.linear(xb, wb))
    c["bf16_eager_cast(x)->.float()"] = lambda: fbf(x, wb)
    def fpm():
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        try: return F.linear(x, w32b)
        finally: torch.backends.mkldnn.matmul.fp32_precision = "ieee"
    c["fpmath_bf16 F.linear(x32,w32b)"] = fpm
    return c

def compiled(variant, wb, x):
    t0 = time.perf_counter()
    if variant != 'freeze_autotune_dyn': torch._dynamo.reset()
    if variant == "compile":
        f = torch.compile(fbf); g = lambda: f(x, wb)
    elif variant == "autotune":
        f = torch.compile(fbf, mode="max-autotune"); g = lambda: f(x, wb)
    elif variant == "freeze":
        ic.freezing = True
        m = Lin(wb).eval(); f = torch.compile(m); g = lambda: f(x)
    elif variant == "freeze_autotune":
        ic.freezing = True
        m = Lin(wb).eval(); f = torch.compile(m, mode="max-autotune"); g = lambda: f(x)
    elif variant == "emulate":
        ic.emulate_precision_casts = True
        f = torch.compile(fbf); g = lambda: f(x, wb)
    elif variant == "freeze_autotune_dyn":
        ic.freezing = True
        m = Lin(wb).eval()
        if not hasattr(compiled, "m"):
            compiled.m = torch.compile(Lin(wb).eval(), mode="max-autotune", dynamic=True)
        compiled.m.w = m.w  # note: weights frozen at first compile; only valid for same N
        f = compiled.m; g = lambda: f(x)
    elif variant == "emulate_freeze_autotune":
        ic.emulate_precision_casts = True; ic.freezing = True
        m = Lin(wb).eval(); f = torch.compile(m, mode="max-autotune"); g = lambda: f(x)
    elif variant == "fpmath_compile":
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        w32b = wb.float(); f = torch.compile(lambda x, w: F.linear(x, w)); g = lambda: f(x, w32b)
    elif variant == "fpmath_freeze":
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"; ic.freezing = True
        m = torch.nn.Linear(576, wb.shape[0], bias=False).eval(); m.weight.data = wb.float()
        f = torch.compile(m); g = lambda: f(x)
    if variant.startswith("fpmath"):
        g0 = g
        def g():
            torch.backends.mkldnn.matmul.fp32_precision = "bf16"
            try: return g0()
            finally: torch.backends.mkldnn.matmul.fp32_precision = "ieee"
    with torch.no_grad(): y = g()
    return g, y, time.perf_counter() - t0

def bench(cands, rounds=15, inner=20):
    res = {k: [] for k in cands}
    with torch.no_grad():
        for k, f in cands.items():
            for _ in range(3): f()
        for r in range(rounds):
            for k, f in cands.items():
                t = time.perf_counter()
                for _ in range(inner): f()
                res[k].append((time.perf_counter()-t)/inner)
    base = res["fp32_eager"]; bb = res["bf16_eager_cast(x)->.float()"]
    out = {}
    for k in res:
        r32 = statistics.median(a/b for a, b in zip(res[k], base))
        rbf = statistics.median(a/b for a, b in zip(res[k], bb))
        out[k] = (r32, rbf)
    return out

for (M, K, N) in SHAPES:
    x = torch.randn(M, K); w = torch.randn(N, K) * (1/K**0.5)
    wb = w.bfloat16(); xb = x.bfloat16()
    ref32 = x.double() @ w.double().T          # fp32 reference (true inputs)
    refbf = xb.double() @ wb.double().T        # exact product of bf16-rounded inputs
    cands = make_candidates(x, w, wb)
    extra = ""
    if variant not in ("eager",):
        g, y, ct = compiled(variant, wb, x)
        cands["compiled:"+variant] = g
        extra = f" compile_s={ct:.1f}"
    print(f"== M={M} K={K} N={N} variant={variant}{extra}")
    with torch.no_grad():
        for k, f in cands.items():
            y = f()
            a1, r1 = err(y, refbf); a2, r2 = err(y, ref32)
            print(f"  {k:36s} {str(y.dtype):15s} vs_bf16exact max_abs={a1:.2e} rel={r1:.2e} | vs_fp32 max_abs={a2:.2e} rel={r2:.2e}")
    for k, (r32, rbf) in bench(cands).items():
        print(f"  {k:36s} time/fp32_eager={r32:.3f}  time/bf16_eager={rbf:.3f}")
