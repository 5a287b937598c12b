"""The verifier's serving engine (docs/architecture.md §6), vLLM v1's split:

    core        the engine core (`StepEngine`: one step = admit, schedule, run, decide, retire) and its thread
    scheduler   which works feed how many positions in the next forward (pure Python)
    runner      the model and its KV cache: pieces in, the step's logits out (static buckets, CUDA graphs)
    judge       every decision of a step in one batched pass: sampling, acceptance, draws; one host read
    transfer    a step's copies to and from the accelerator, none of which waits for it (`HostPack`, `HostRead`)
    sessions    the open sessions and their KV-cache slots
    works       the request state: one work per request in flight (open, resume, verification), data the core steps
    verifier    `CloudVerifier`, the facade the in-process tools and the Verifier deployment call (the batch API,
                admission, the step's decisions handed to the works) and `InProcessCloud`
    service     `VerifierService`: the engine on its own thread with its watchdog, what a Verifier replica runs
"""
