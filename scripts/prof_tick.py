import time, torch, numpy as np, statistics as st
import tripwire
from tripwire import Monitor, SiteRegistry
reg = SiteRegistry(capacity=1024)
for i in range(1024): reg.register(f"s{i}")
m = Monitor(registry=reg, capacity=1024, idle_tail=1e9)
m.prealloc("cuda")
r = m.readers()["cuda:0"]
arena = m.arena.get(torch.device("cuda:0"))
def t(fn, n=2000):
    xs=[]
    for _ in range(n):
        a=time.perf_counter(); fn(); xs.append(time.perf_counter()-a)
    xs.sort(); return f"p50 {xs[len(xs)//2]*1e6:.1f}us p99 {xs[int(len(xs)*.99)]*1e6:.1f}us"
torch.cuda.synchronize()
print("event.query", t(lambda: r.event.query()))
print("mirror numpy copy", t(lambda: r.mirror[:1024].numpy().copy()))
def cp():
    with torch.cuda.stream(r.stream):
        r.mirror[:1024].copy_(arena[:1024], non_blocking=True)
print("copy_ in stream ctx", t(cp)); torch.cuda.synchronize()
print("slice", t(lambda: arena[:1024]))
print("stream ctx", t(lambda: torch.cuda.stream(r.stream).__enter__()))
print("record", t(lambda: r.event.record(r.stream)))
print("reader.poll", t(lambda: r.poll(1024)))
print("monitor.poll", t(lambda: m.poll()))
torch.cuda._sleep(2_000_000_000)
print("monitor.poll busy", t(lambda: m.poll(), 300))
torch.cuda.synchronize()
