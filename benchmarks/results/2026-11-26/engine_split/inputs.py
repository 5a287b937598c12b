"""Host-side cost of one engine step's input building (the forward itself stubbed): old row-by-row vs new."""
import sys, time, json, torch
torch.set_num_threads(1)
from ciar.world import load_world
from ciar.engine.verifier import CloudVerifier
from ciar.collab.protocol import OpenRequest, VerifyRequest
world = load_world(None)
cloud = world.cloud
c = cloud.config
out = {}
for works in (8, 32, 64):
    v = CloudVerifier(cloud, world.text, max_sessions=works)
    from ciar.decoding.sampling import SamplingParams
    v.open_batch([OpenRequest(f"s{i}", "a red circle", seed=i, sampling=world.sampling, prefix_len=4) for i in range(works)])
    g = torch.Generator().manual_seed(0)
    for i in range(works):
        v.submit_verify(VerifyRequest(f"s{i}", torch.randint(0, c.vocab_size, (3,), generator=g),
                                      torch.randint(0, c.vocab_size, (4,), generator=g),
                                      torch.full((4, c.vocab_size), 1.0 / c.vocab_size).half()))
    eng = v.engine
    if hasattr(eng, "_select"):   # old
        eng._admit()
        pieces = eng._select()
        run = lambda: eng._forward(pieces)
    else:
        eng._admit()
        batch = eng.scheduler.schedule()
        pieces = [p.request.piece(p.n) for p in batch]
        run = lambda: v.runner.execute(pieces)
    real = cloud.forward_cached
    cloud.forward_cached = lambda cache, h, pos, slots=None, kv_len=None, packed=None, **k: torch.zeros(h.shape[0], h.shape[1], c.dim)
    with torch.inference_mode():
        for _ in range(3): run()
        ts = []
        for _ in range(30):
            t = time.perf_counter(); run(); ts.append(time.perf_counter() - t)
    cloud.forward_cached = real
    ts.sort()
    out[works] = round(1e3 * ts[len(ts) // 2], 3)
print(json.dumps(out))
