"""Selective-op's per-op cost, paired: forward+backward of a zoo block (llama-tiny, gpt-tiny) and
of chains of k ``sin`` ops under no / full / selective-op checkpointing, one thread, medians of
interleaved repeats. See [Note: selective checkpointing] in wrapopt/selective.py.

Usage (from the repository root):
    PYTHONPATH=$PWD python scripts/sac_overhead.py [repeats=150]
Prints per case its forward ops (a dispatch mode's count), the medians in us, selective - full
(in all, per op) and forward-only selective - full. Not a test: a measurement."""
import copy
import sys
import time
from statistics import median
import numpy as np
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.distributed._composable import checkpoint
from wrapopt.models import zoo
from wrapopt.selective import selective_context_fn
torch.set_num_threads(1)

class Count(TorchDispatchMode):
    def __init__(self): super().__init__(); self.n = 0
    def __torch_dispatch__(self, f, t, a=(), k=None):
        self.n += 1; return f(*a, **(k or {}))

class Chain(nn.Module):  # k cheap elementwise ops (each saves its input) on a small tensor
    def __init__(self, k): super().__init__(); self.k = k; self.lin = nn.Linear(64, 64)
    def forward(self, x):
        x = self.lin(x)
        for _ in range(self.k): x = torch.sin(x)
        return x

def block_case(name):
    model, inputs = zoo.build(name)
    blk = model.blocks[0] if hasattr(model, "blocks") else model.layers[0]
    cap = {}
    h = blk.register_forward_pre_hook(lambda m, a, kw: cap.setdefault("c", (a, kw)), with_kwargs=True)
    with torch.no_grad(): model(*inputs)
    h.remove()
    return blk, cap["c"]

def run(blk, args, kwargs, reps):
    plain, full, sac = copy.deepcopy(blk), copy.deepcopy(blk), copy.deepcopy(blk)
    checkpoint(full); checkpoint(sac, context_fn=selective_context_fn)
    def fresh():
        return tuple(a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                     for a in args)
    def fb(b, bwd=True):
        def go():
            out = b(*fresh(), **kwargs)
            if bwd: out.float().sum().backward()
        return go
    def fwd_nograd_count(b):
        c = Count()
        with c: b(*fresh(), **kwargs)
        return c.n
    nops = fwd_nograd_count(plain)
    fns = {"none": fb(plain), "full": fb(full), "sac": fb(sac), "fwd": fb(plain, False),
           "full_fwd": fb(full, False), "sac_fwd": fb(sac, False)}
    ts = {k: [] for k in fns}
    for r in range(3 + reps):
        for k, fn in fns.items():
            t0 = time.perf_counter(); fn(); dt = time.perf_counter() - t0
            if r >= 3: ts[k].append(dt)
    m = {k: median(v) * 1e6 for k, v in ts.items()}
    return nops, m

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 150
rows = []
for name in ("llama-tiny", "gpt-tiny"):
    blk, (a, kw) = block_case(name)
    rows.append((f"{name} block", *run(blk, a, kw, reps)))
for k in (0, 25, 50, 100, 200):
    rows.append((f"chain k={k}", *run(Chain(k), (torch.randn(4, 64, 64),), {}, reps)))
print(f"{'case':16} {'ops':>5} {'none':>7} {'full':>7} {'sac':>7} {'fullfwd':>7} {'sacfwd':>7} {'sac-full':>8} "
      f"{'us/op':>6} {'fwdΔ':>6} {'fwdΔ/op':>7}")
for name, n, m in rows:
    d = m["sac"] - m["full"]
    df = m['sac_fwd'] - m['full_fwd']
    print(f"{name:16} {n:5d} {m['none']:7.0f} {m['full']:7.0f} {m['sac']:7.0f} {m['full_fwd']:7.0f} "
          f"{m['sac_fwd']:7.0f} {d:8.0f} {d/n:6.1f} {df:6.0f} {df/n:7.1f}")

ch = [(n, m) for name, n, m in rows if name.startswith('chain')]
x = np.array([n for n, _ in ch])
y = np.array([m['sac'] - m['full'] for _, m in ch])
yf = np.array([m['sac_fwd'] - m['full_fwd'] for _, m in ch])
print('chain slope sac-full us/op:', np.polyfit(x, y, 1), ' fwd-only slope:', np.polyfit(x, yf, 1))
