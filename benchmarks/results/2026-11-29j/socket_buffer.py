"""The engine process's socket buffers, interleaved A/B on this CPU (the forward stubbed, 16,384 codes, 256 phones,
64 works a step at most): the kernel's default 208 KiB against `ciar.engine.process.SOCKET_BUFFER_BYTES`.

    python benchmarks/results/2026-11-29j/socket_buffer.py > benchmarks/results/2026-11-29j/socket_buffer.jsonl
"""

import json
import statistics

import torch

from benchmarks import engine_thread as et
from ciar.engine import process

RAISED = process.SOCKET_BUFFER_BYTES


def main(reps: int = 3) -> None:
    torch.set_flush_denormal(True)  # (as engine_thread's ways run)
    runs: dict = {"208KiB": [], "raised": []}
    for rep in range(reps):
        for name, size in (("208KiB", 212992), ("raised", RAISED)):
            process.SOCKET_BUFFER_BYTES = size  # (read when an EngineProcess starts)
            row = et.process(16384, 256, 64, 4.0, 1.0, None, True)
            runs[name].append(row)
            print(json.dumps({"rep": rep, "buffer": name, "bytes": size, **row}), flush=True)
    process.SOCKET_BUFFER_BYTES = RAISED
    print(json.dumps({"medians": {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                                  for name, rows in runs.items()}}))


if __name__ == "__main__":
    main()
