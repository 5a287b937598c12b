"""ciar.capacity.gpu_model: the GPU cost model's arithmetic on hand-worked cases, its parameter counts against the real
modules, and the modelled replica's forwards per request."""

import math

import numpy as np
import pytest
import torch

from ciar.collab.protocol import OpenRequest, VerifyRequest
from ciar.capacity.trace import SessionTrace, TraceStep
from ciar.decoding.sampling import SamplingParams
from ciar.capacity.gpu_model import (FLAN_T5_XL, GPU, Engine, ModelShapes, encode_s, forward_s, image_forward_s,
                                 session_slots, simulate, t5_encoder_params, verify_plan)

# a fictional GPU with round figures: 1 GB/s, 1 TFLOP/s, 1 GB
ROUND = GPU("round", 1e9, 1e12, 1e9, "test")
# dim 128, 2 layers, full-width K/V, ffn 512, vocab 1024, 8 caption positions, 16 image tokens
SMALL = ModelShapes(dim=128, n_layer=2, kv_dim=128, ffn_hidden=512, vocab_size=1024, cls_token_num=8, block_size=16)


def test_forward_time_by_hand():
    # weights read: per layer wq + wo 2*128*128 = 32,768, wk + wv 32,768, w1 w3 w2 3*128*512 = 196,608, norms 256
    # -> 262,400 x 2 layers = 524,800; final norm 128, head 1024*128 = 131,072 -> 656,000 params = 1,312,000 bytes
    assert SMALL.weight_params == 656_000
    # one decode of one session (2 CFG rows), each row reading 11 keys: KV 2 rows x 11 keys x 2 layers x (k, v)
    # x 128 x 2 bytes = 22,528 bytes -> 1,334,528 bytes at 1 GB/s = 1.334528 ms
    # FLOPs: 2 x 656,000 x 2 positions = 2,624,000 + attention 4 x 2 layers x 128 x (2 rows x 1 x 11) = 22,528
    # -> 2.646528 MFLOP at 1 TFLOP/s = 2.65 us: memory-bound; + 1 ms overhead = 2.334528 ms
    assert forward_s(ROUND, SMALL, [(2, 1, 11)], overhead_s=1e-3) == pytest.approx(2.334528e-3, rel=1e-12)
    # the same forward on a GPU of 1 GFLOP/s is compute-bound: 2.646528 ms + 1 ms
    slow = GPU("slow", 1e9, 1e9, 1e9, "test")
    assert forward_s(slow, SMALL, [(2, 1, 11)], overhead_s=1e-3) == pytest.approx(3.646528e-3, rel=1e-12)
    # two pieces add their rows' keys and positions: a span of 4 positions reading 14 keys next to the decode
    # bytes 1,312,000 + (2 layers x (k, v) x 128 x 2 bytes = 1,024 per key) x (22 + 2 x 14 keys) = 1,363,200;
    # flops 2 x 656,000 x 10 positions + 4 x 2 x 128 x (22 + 2 x 4 x 14) = 13,257,216: memory-bound, 1.3632 ms
    assert forward_s(ROUND, SMALL, [(2, 1, 11), (2, 4, 14)], overhead_s=0.0) == pytest.approx(1.3632e-3, rel=1e-12)


def test_a_served_step_by_hand():
    """`ServedCosts`: a step priced as the served engine runs it. Three one-token decodes and a 5-token span (8 rows,
    width 5) are one forward padded to the (8, 8) bucket; a 120-token prefill chunk (2 rows) a forward of its own,
    padded to (2, 128); the judge and host once a step, and per work."""
    from types import SimpleNamespace

    from ciar.capacity.gpu_model import ServedCosts
    from ciar.engine.scheduler import DECODE, PREFILL, SPAN, Scheduled

    two = SimpleNamespace(rows=2)
    batch = [Scheduled(two, DECODE, 40, 1)] * 3 + [Scheduled(two, SPAN, 40, 5), Scheduled(two, PREFILL, 0, 120)]
    costs = ServedCosts(forward_a_s=1e-3, forward_b_s=1e-6, step_a_s=2e-3, step_b_s=1e-4)
    # forwards: (1 ms + 64 us) + (1 ms + 256 us); the step: 2 ms + 5 works x 0.1 ms
    assert costs.step_s(batch) == pytest.approx(1.064e-3 + 1.256e-3 + 2.5e-3, rel=1e-12)
    assert costs.step_s(batch[:3]) == pytest.approx(1e-3 + 8e-6 + 2.3e-3, rel=1e-12)  # 6 rows -> 8, width 1
    # the modelled replica takes it in place of the roofline forward
    from ciar.capacity.gpu_model import ModelledRunner

    assert ModelledRunner(ROUND, SMALL, 3e-3, costs).cost(batch) == pytest.approx(costs.step_s(batch), rel=1e-12)


def test_served_costs_fitted_from_a_gpu_run():
    """benchmarks.engine_capacity.served_costs: a forward's time against its padded positions by least squares over
    served_steps' buckets, the judge and host of engine_graphs; None without them."""
    from benchmarks.engine_capacity import served_costs

    steps = [{"bucket": [r, w, 376], "served_ms": 2.0 + 0.01 * r * w} for r in (2, 8, 32, 128) for w in (1, 8)]
    split = {"steps": 9, "step": 9.0, "forward": 4.0, "judge": 3.0, "host": 2.0}
    c = served_costs({"served_steps": {"steps": steps}, "engine_graphs": {"sessions": 16, "graphs": {
        "ms_per_step_after_warmup": split}}})
    assert c.forward_a_s == pytest.approx(2e-3) and c.forward_b_s == pytest.approx(1e-5)
    assert c.step_a_s == pytest.approx(5e-3) and c.step_b_s == 0.0  # judge + host
    c = served_costs({"served_steps": {"steps": steps}, "engine_graphs": {"graphs": {"ms_per_step_after_warmup": {
        **split, "median": {"step": 7.0, "forward": 4.5, "judge": 1.5}}}}})
    assert c.step_a_s == pytest.approx(2.5e-3)  # the medians where the run has them: judge 1.5, host 7 - 4.5 - 1.5
    assert served_costs({"served_steps": {"steps": steps}}) is None
    assert served_costs({"engine_graphs": {"graphs": {"ms_per_step_after_warmup": split}}}) is None


def test_llamagen_xl_shapes_and_memory():
    xl = ModelShapes.llamagen_xl()
    assert (xl.dim, xl.n_layer, xl.kv_dim, xl.ffn_hidden, xl.vocab_size, xl.cls_token_num, xl.block_size) == \
        (1280, 36, 1280, 3584, 16384, 120, 256)
    # 36 x (4 x 1280^2 + 3 x 1280 x 3584 + 2 x 1280) + 1280 + 16384 x 1280 = 752,446,720 (1.50 GB bf16)
    assert xl.weight_params == 752_446_720
    # KV: 2 rows x 36 layers x (k, v) x 1280 x (120 + 256 + 16) positions x 2 bytes
    assert xl.session_bytes() == 2 * 36 * 2 * 1280 * 392 * 2
    # flan-t5-xl's encoder: 24 x (4 x 2048^2 + 3 x 2048 x 5120 + 2 x 2048) + 32128 x 2048 + 32 x 32 + 2048
    assert t5_encoder_params() == 1_223_527_424
    # 80 GB x 0.9 - (752.4 M + 21.0 M embedding + 1223.5 M T5) x 2 bytes = 68.0 GB -> 470 sessions of 144.5 MB
    assert session_slots(GPU("80", 3.35e12, 989e12, 80e9, ""), xl) == 470
    # one decode step of 64 sessions at mid-image on the H100: KV (128 rows x 249 keys x 184,320 B) + weights,
    # over 3.35 TB/s, memory-bound
    t = forward_s(GPU("h100", 3.35e12, 989e12, 80e9, ""), xl, [(2, 1, 249)] * 64, overhead_s=0.0)
    assert t == pytest.approx((2 * 752_446_720 + 128 * 249 * 36 * 2 * 1280 * 2) / 3.35e12, rel=1e-12)


def test_parameter_counts_match_the_modules():
    from transformers import T5Config, T5EncoderModel

    from ciar.models.gpt import build_gpt

    gpt = build_gpt("GPT-B", n_layer=2, dim=64, n_head=4, caption_dim=32, cls_token_num=8, vocab_size=64,
                    block_size=16)
    read = sum(p.numel() for n, p in gpt.named_parameters() if not n.startswith(("tok_embeddings", "cls_embedding")))
    assert ModelShapes.from_config(gpt.config).weight_params == read
    cfg = {**FLAN_T5_XL, "vocab_size": 100, "d_model": 32, "d_kv": 8, "d_ff": 48, "num_layers": 2, "num_heads": 4,
           "relative_attention_num_buckets": 8}
    model = T5EncoderModel(T5Config(**cfg))
    assert t5_encoder_params(cfg) == sum(p.numel() for p in model.parameters())
    # caption encoding: weights once, FLOPs per caption; nothing without new captions
    shapes = ModelShapes.from_config(gpt.config, text_params=1000, text_positions=10)
    assert encode_s(ROUND, shapes, 0) == 0.0
    assert encode_s(ROUND, shapes, 3, overhead_s=0.0) == pytest.approx(2000 / 1e9)


def _trace(prefix_len: int, steps=()) -> SessionTrace:
    t = SessionTrace(OpenRequest("s", "a caption", 0, SamplingParams(cfg_scale=2.0), prefix_len), [1] * prefix_len,
                     (100, 100), vocab_size=1024)
    for m, k, accepted, burst, g in steps:
        req = VerifyRequest("s", torch.ones(m, dtype=torch.long), torch.ones(k, dtype=torch.long),
                            torch.zeros(k, 1024, dtype=torch.float16), burst=g)
        t.steps.append(TraceStep(0.01, req, accepted, 1, [1] * burst))
    return t


def test_modelled_replica_counts_the_engines_forwards():
    # cloud-only: the prefill (8 caption positions in one piece) and 15 decodes
    cloud = _trace(16)
    seconds, forwards = image_forward_s(cloud, 16, ROUND, SMALL, Engine(overhead_s=0.0))
    assert forwards == 16
    expected = forward_s(ROUND, SMALL, [(2, 8, 8)], 0.0) + sum(forward_s(ROUND, SMALL, [(2, 1, 8 + j)], 0.0)
                                                               for j in range(1, 16))
    assert seconds == pytest.approx(expected, rel=1e-12)
    # CIAR: prefix 2; a verify of 3 new + 4 drafts, 1 accepted, 2 burst tokens of 3 allowed (stopped on entropy:
    # one more forward); then a fully accepted span of 2 (no burst)
    ciar = _trace(2, [(3, 4, 1, 2, 3), (0, 2, 2, 0, 3)])
    plan = verify_plan(ciar, 16)
    # feed from image position 1 (the committed-but-unfed token) : 1 + 3 + 4 = 8 positions; after the verdict
    # 2 + 3 + 1 + 1 = 7 tokens, decodes from image position 6; then 7 + 2 burst = 9 committed, the next feed from
    # 8: 1 + 0 + 2 positions; 9 + 2 + the bonus = 12 tokens (no decodes, which would start at 11)
    assert plan == [(1, 8, 3, 6), (8, 3, 0, 11)]
    _, forwards = image_forward_s(ciar, 16, ROUND, SMALL, Engine(overhead_s=0.0))
    assert forwards == 2 + (1 + 3) + 1


def test_load_point_batches_the_phones():
    traces = [_trace(16), _trace(16)]
    one = simulate(traces, 16, ROUND, SMALL, phones=1, network="none", duration_s=5.0, warmup_s=1.0)
    many = simulate(traces, 16, ROUND, SMALL, phones=8, network="none", duration_s=5.0, warmup_s=1.0)
    assert one["mean_batch_size"] == 1.0 and many["mean_batch_size"] > 4
    assert many["images_per_s"] > 4 * one["images_per_s"]
    assert np.isclose(one["verifier_forwards_per_image"], 16, rtol=0.1)
    for p in (one, many):  # the steps as the engine's are reported: their pieces by class add up to the works a step
        assert sum(p["pieces_per_step"].values()) == pytest.approx(p["mean_batch_size"])
        assert p["steps_per_s"] * 5.0 == pytest.approx(p["verifier_forwards_per_image"] * p["images"], rel=1e-9)


def test_capacity_cli_writes_the_modelled_plan(tmp_path):
    import json

    from loadtests.capacity import main

    out = tmp_path / "plan"
    assert main(["--out", str(out), "--cost-model", "gpu:l4", "--traces", "1", "--phones", "1,2", "--duration", "5",
                 "--warmup", "1", "--traces-dir", str(tmp_path / "traces"), "--verifier", '{"max_batch_size": 8}']) == 0
    r = json.loads((out / "gpu_capacity.json").read_text())
    assert "modelled, not measured" in r["model"] and r["engine"]["max_works"] == 8
    l4 = r["gpus"]["l4"]
    assert set(l4["phones_at_slo"]) == {"ciar", "cloud"} and l4["cloud_forwards_per_image_alone"]["cloud"] == 144
    assert "a MODEL, not a measurement" in (out / "gpu_capacity.md").read_text()
    assert (tmp_path / "traces" / "ciar.pt").is_file()  # kept for the next run
    with pytest.raises(SystemExit):
        main(["--out", str(out), "--cost-model", "gpu:tpu"])


def _wave_replay_real(traces, tiny_cloud, stub_text, scheduler):
    """The recorded sessions on the real verifier in waves: every open at once, then every session's j-th
    verification at once (each wave stepped until done). -> the engine's schedule, step by step."""
    from dataclasses import replace

    from ciar.engine.verifier import CloudVerifier

    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=len(traces), scheduler=scheduler)
    sid = [f"s{i}" for i in range(len(traces))]
    v._run([v.submit_open(replace(t.open, session_id=s)) for t, s in zip(traces, sid)])
    for j in range(max(len(t.steps) for t in traces)):
        works = [v.submit_verify(replace(t.steps[j].request, session_id=s))
                 for t, s in zip(traces, sid) if j < len(t.steps)]
        replies = v._run(works)
        recorded = [t.steps[j] for t in traces if j < len(t.steps)]
        assert [(r.num_accepted, r.next_token) for r in replies] == \
            [(s.num_accepted, s.next_token) for s in recorded]  # the replay is the recorded run
    return [s["pieces"] for s in v.engine.step_log]


def _wave_replay_model(traces, shapes, engine, image_tokens):
    from ciar.capacity.gpu_model import ReplicaModel, Sim

    sim = Sim()
    replica = ReplicaModel(sim, ROUND, shapes, len(traces), engine)
    for t in traces:
        replica.open(t.open.prefix_len, lambda forwards: None)
    sim.run(math.inf)
    plans = [verify_plan(t, image_tokens) for t in traces]
    for j in range(max(len(t.steps) for t in traces)):
        for plan in plans:
            if j < len(plan):
                replica.verify(*plan[j], lambda forwards: None)
        sim.run(math.inf)
    return [s["pieces"] for s in replica.scheduler.step_log]


@pytest.mark.parametrize("budget", [1024, 24])
def test_the_model_schedules_recorded_sessions_as_the_real_engine_does(tiny_cloud, tiny_device, stub_text, median_tau,
                                                                       budget):
    """The capacity model drives the engine's own scheduler: recorded CIAR (with bursts) and cloud-only sessions,
    replayed through the real verifier (model runner, judge) and through the modelled replica (modelled works and
    runner), give the same schedule step by step: the same pieces (class, first position, length, rows) in the same
    forwards, with a roomy budget and with one that chunks prefills and spans."""
    from ciar.sim.decoder import CollabDecoder, method_config
    from ciar.engine.core import SchedulerConfig
    from ciar.capacity.gpu_model import Engine, ModelShapes
    from ciar.capacity.trace import TracingClient
    from ciar.engine.verifier import CloudVerifier, InProcessCloud

    n = tiny_cloud.config.block_size
    rec = TracingClient(InProcessCloud(CloudVerifier(tiny_cloud, stub_text, max_sessions=2)))
    params = SamplingParams(cfg_scale=2.0, temperature=1.0)
    for i, (method, kw) in enumerate([("ciar", dict(tau=median_tau, burst=2)), ("ciar", dict(tau=median_tau)),
                                      ("cloud", {}), ("ciar", dict(tau=median_tau, burst=3))]):
        CollabDecoder(tiny_device, rec, method_config(method, network="none", **kw), params,
                      num_tokens=n).generate(f"prompt number {i}", seed=i, session_id=f"rec{i}")
    traces = rec.sessions
    assert any(s.burst_tokens for t in traces for s in t.steps)  # bursts are part of what is compared
    engine = Engine(token_budget=budget, max_works=3)
    real = _wave_replay_real(traces, tiny_cloud, stub_text, SchedulerConfig(budget, 3, engine.prefill_chunk))
    model = _wave_replay_model(traces, ModelShapes.from_config(tiny_cloud.config), engine, n)
    assert len(real) > len(traces) and max(len(step) for step in real) > 1  # several steps, some of them shared
    assert model == real


def test_refit_cli_says_what_is_missing(tmp_path, capsys):
    """engine_capacity --refit on a result without what it needs: exit 2 and a readable line, not a traceback."""
    import json

    from benchmarks.engine_capacity import main

    assert main(["--refit", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err
    partial = tmp_path / "gpu.json"
    partial.write_text(json.dumps({"sections": {"env": {}, "capacity_measured": {"skipped": "budget"}}}))
    assert main(["--refit", str(partial)]) == 2
    assert "has no measured capacity_measured section" in capsys.readouterr().err
    partial.write_text(json.dumps({"sections": {"capacity_measured": {"points": {}}}}))
    assert main(["--refit", str(partial)]) == 2
    assert "no roofline section" in capsys.readouterr().err
