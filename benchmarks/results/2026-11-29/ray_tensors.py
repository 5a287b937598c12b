"""What a Ray actor call carrying a VERIFY costs with torch's tensor pickling and with the fast form
(`services.verifier_client.fast_tensors`), in one run: a caller actor sends VerifyRequests (4 drafts, their float16
draft distributions over V codes) to a receiver actor that answers with a VerifyReply carrying 2 burst tokens; the
caller waits for each reply before the next (one call in flight: the calls' own CPU and latency, not Ray's
concurrency). Both actors register the fast form, or neither. Reported: calls per second and the CPU seconds each
side spent per call. The ratio is the result (this box's times).

    python benchmarks/results/2026-11-29/ray_tensors.py [CALLS] [VOCAB...]
"""

import json
import resource
import sys
import time

import ray
import torch


def _setup(fast: bool) -> None:
    torch.set_num_threads(1)
    if fast:  # this actor's calls carry tensors in the fast form
        from services.verifier_client import fast_tensors

        fast_tensors()


@ray.remote(num_cpus=0.5)
class Receiver:
    def __init__(self, fast: bool):
        _setup(fast)

    def verify(self, request):
        from ciar.collab.protocol import VerifyReply

        return VerifyReply(request.session_id, 2, 7, True, 0.001, 1, 1, burst_tokens=torch.tensor([3, 4]),
                           vocab_size=request.draft_probs.shape[1])

    def cpu_s(self):
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime


@ray.remote(num_cpus=0.5)
class Caller:
    def __init__(self, fast: bool):
        _setup(fast)

    def run(self, receiver, calls: int, vocab: int):
        from ciar.collab.protocol import VerifyRequest

        q = torch.full((4, vocab), 1.0 / vocab, dtype=torch.float16)
        req = VerifyRequest("s", torch.zeros(3, dtype=torch.long), torch.randint(0, vocab, (4,)), q, burst=2)
        for _ in range(20):  # warm-up
            ray.get(receiver.verify.remote(req))
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        c0 = ray.get(receiver.cpu_s.remote())
        t0 = time.perf_counter()
        for _ in range(calls):
            reply = ray.get(receiver.verify.remote(req))
        seconds = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        c1 = ray.get(receiver.cpu_s.remote())
        assert reply.burst_tokens.tolist() == [3, 4]
        return {"calls_per_s": calls / seconds,
                "caller_cpu_us_per_call": 1e6 * (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / calls,
                "receiver_cpu_us_per_call": 1e6 * (c1 - c0) / calls}


def main():
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    vocabs = [int(v) for v in sys.argv[2:]] or [1024, 16384]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ":".join(p for p in sys.path if p)}})
    rows = []
    for vocab in vocabs:
        for rep in range(2):
            for fast in (False, True):  # interleaved
                receiver, caller = Receiver.remote(fast), Caller.remote(fast)
                r = ray.get(caller.run.remote(receiver, calls, vocab))
                r.update(vocab=vocab, fast=fast, rep=rep)
                rows.append(r)
                print(json.dumps(r), flush=True)
                ray.kill(caller)
                ray.kill(receiver)
    ray.shutdown()


if __name__ == "__main__":
    main()
