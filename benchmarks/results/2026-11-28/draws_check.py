"""The acceptance the new cloud draws give, beside the previous engine's, on the shipped world (issue 48, item 2).

    git worktree add /tmp/ciar-before b0bb2c9                       # the engine before the counter-based draws
    .venv/bin/python benchmarks/results/2026-11-28/draws_check.py /tmp/ciar-before 6 > before.json
    .venv/bin/python benchmarks/results/2026-11-28/draws_check.py . 6 > after.json

For the checkout given (imported ahead of the installed one): EAGLE (every token verified, exact acceptance) and
CIAR at its calibrated point (`policy: fixed`) on 6 prompts x N seeds (100..), per-draft acceptance and cloud
tokens. The draws differ between the two, so images differ; the rates must agree within seed-to-seed noise.
"""
import json
import sys

import torch

sys.path[:0] = [sys.argv[1], sys.argv[1] + "/device"]
import ciar  # noqa: E402
from ciar.sim.runtime import make_decoder, make_verifier  # noqa: E402
from ciar.world import load_world  # noqa: E402

torch.set_num_threads(1)
world = load_world(None)
v = make_verifier(world, max_sessions=2)
prompts = ["a small red circle at the top on a gray background", "two green triangles at the left on a white background",
           "a large blue square and a yellow circle at the bottom", "a purple square on a black background",
           "three small yellow circles in the middle", "an orange triangle at the right on a gray background"]
out = {"imported": ciar.__file__}
for method in ("eagle", "ciar"):
    dec = make_decoder(world, v, method, **({"policy": "fixed"} if method == "ciar" else {}))
    d = a = c = 0
    for p in prompts:
        for seed in range(int(sys.argv[2])):
            st = dec.generate(p, seed=100 + seed).stats.to_dict()
            d, a, c = d + st["drafted"], a + st["accepted"], c + st["cloud_tokens"]
    out[method] = dict(drafted=d, accepted=a, rate=a / max(d, 1), cloud_tokens=c)
print(json.dumps(out))
