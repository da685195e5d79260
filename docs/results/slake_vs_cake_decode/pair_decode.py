"""Paired, interleaved decode timing in one process.

Used for the SLAKE/CAKE decode ratio in docs/results-speed-memory.md, "SLAKE's decode step against CAKE's".

Two caches (A and B) are prefilled with the same random prompt on one model; then decode steps alternate A, B / B, A
(the order flips every round). With --cpu-time the thread CPU time of each step is measured, which is stable on a
loaded machine when torch uses one thread (--threads 1). Prints medians and the median of the per-round ratios A/B.

Example: python docs/results/slake_vs_cake_decode/pair_decode.py --lengths 1024,4096,8192 --rounds 30 --threads 1 --cpu-time
"""
import sys, time, statistics, argparse, torch
import slake
from slake.hf.cache import SlakeCache
from slake.hf.generate import prefill
p = argparse.ArgumentParser()
p.add_argument("--a", default="slake"); p.add_argument("--b", default="cake")
p.add_argument("--a-kw", default=""); p.add_argument("--b-kw", default="")
p.add_argument("--lengths", default="1024,4096,8192"); p.add_argument("--rounds", type=int, default=40)
p.add_argument("--budget", default="128"); p.add_argument("--cpu-time", action="store_true"); p.add_argument("--threads", type=int, default=None)
a = p.parse_args()
if a.threads: torch.set_num_threads(a.threads)
model, _ = slake.load_model()
L = model.config.num_hidden_layers
kw = lambda s: dict(x.split("=") for x in s.split(",") if x)
for n in map(int, a.lengths.split(",")):
    ids = torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    st = {}
    for name, k in ((a.a, kw(a.a_kw)), (a.b, kw(a.b_kw))):
        c = SlakeCache(name.split("@")[0], a.budget, L, **k)
        lg = prefill(model, c, ids, torch.ones_like(ids))
        st[name] = [c, lg.argmax(-1, keepdim=True)]
    def step(name):
        c, t = st[name]
        clk = time.thread_time if a.cpu_time else time.perf_counter
        s = clk()
        with torch.inference_mode():
            out = model(t, past_key_values=c, use_cache=True)
        st[name][1] = out.logits[:, -1].argmax(-1, keepdim=True)
        return (clk() - s) * 1e3
    for _ in range(3): step(a.a); step(a.b)
    ta, tb, r = [], [], []
    for i in range(a.rounds):
        if i % 2: y = step(a.b); x = step(a.a)
        else: x = step(a.a); y = step(a.b)
        ta.append(x); tb.append(y); r.append(x / y)
    q = statistics.quantiles(r, n=4)
    print(f"L={n}: {a.a} median {statistics.median(ta):.2f} ms, {a.b} median {statistics.median(tb):.2f} ms, "
          f"ratio of medians {statistics.median(ta)/statistics.median(tb):.3f}, median paired ratio {statistics.median(r):.3f} "
          f"(IQR {q[0]:.3f}-{q[2]:.3f}), load {open('/proc/loadavg').read().split()[0]}", flush=True)
