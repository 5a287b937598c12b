"""Cloud-only generation with the static KV cache equals a naive loop over the full (uncached) forward."""

import pytest
import torch

from ciar.decoding.generate import generate_cloud
from ciar.decoding.sampling import SamplingParams, logits_to_probs
from ciar_device import maths
from ciar.models.gpt import build_gpt

torch.set_num_threads(1)

N = 24  # tokens per test image (block_size is 144; the loop is the same for every length)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_gpt("scenes-cloud", n_layer=2, dim=64, n_head=4)
    torch.nn.init.normal_(m.output.weight, std=0.5)  # the zero-initialised head would give uniform logits
    return m.eval()


@pytest.fixture(scope="module")
def cond():
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(3, 40, 384, generator=g)
    mask = torch.ones(3, 40, dtype=torch.bool)
    mask[0, :31] = False  # left padding of different lengths, as TextEncoder produces
    mask[1, :20] = False
    emb[~mask] = 0
    return emb, mask


@torch.no_grad()
def naive_generate(model, emb, mask, params, seed, n):
    """Re-run the whole sequence through `model(...)` for every token; each row's token i is the device's own
    inverse-CDF draw (`ciar_device.maths.sample`, numpy) at `uniform(seed + row, CLOUD_STREAM, i)`: the draws
    generate_cloud promises, computed independently of its torch code."""
    b = emb.shape[0]
    drop = None
    if params.uses_cfg:
        emb, mask, drop = model.cfg_condition(emb, mask)
    tokens = torch.empty(b, 0, dtype=torch.long)
    for i in range(n):
        idx = torch.cat([tokens, tokens]) if params.uses_cfg else tokens
        logits = model(idx, emb, mask, drop)[0][:, -1]  # [rows, V]
        if params.uses_cfg:
            probs = logits_to_probs(logits[:b], params, uncond_logits=logits[b:])
        else:
            probs = logits_to_probs(logits, params)
        tok = [maths.sample(probs[r].numpy(), maths.uniform(seed + r, maths.CLOUD_STREAM, i)) for r in range(b)]
        tokens = torch.cat([tokens, torch.tensor(tok)[:, None]], dim=1)
    return tokens


@pytest.mark.parametrize("cfg_scale", [1.0, 4.0])
def test_greedy_equals_naive_loop(model, cond, cfg_scale):
    params = SamplingParams(cfg_scale=cfg_scale, temperature=0.0)
    got = generate_cloud(model, *cond, params, 0, num_tokens=N)
    want = naive_generate(model, *cond, params, 0, N)
    assert got.shape == (3, N) and got.dtype == torch.int64
    assert torch.equal(got, want)
    assert len(set(got.flatten().tolist())) > 3  # not a degenerate constant sequence


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_sampling_equals_naive_loop_with_same_draws(model, cond, cfg_scale):
    params = SamplingParams(cfg_scale=cfg_scale, temperature=1.0, top_k=100)
    got = generate_cloud(model, *cond, params, 7, num_tokens=N)
    want = naive_generate(model, *cond, params, 7, N)
    assert torch.equal(got, want)


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_seeded_sampling_is_deterministic(model, cond, cfg_scale):
    params = SamplingParams(cfg_scale=cfg_scale, temperature=1.0, top_p=0.9)
    a = generate_cloud(model, *cond, params, 3)
    b = generate_cloud(model, *cond, params, 3)
    c = generate_cloud(model, *cond, params, 4)
    assert a.shape == (3, model.config.block_size)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_cfg_changes_the_result(model, cond):
    plain = generate_cloud(model, *cond, SamplingParams(temperature=0.0), 0, num_tokens=N)
    guided = generate_cloud(model, *cond, SamplingParams(cfg_scale=4.0, temperature=0.0), 0, num_tokens=N)
    assert not torch.equal(plain, guided)


def test_return_probs_and_cache_reuse(model, cond):
    params = SamplingParams(cfg_scale=2.0, top_k=50)
    cache = model.new_cache(8)
    tokens, probs = generate_cloud(model, *cond, params, 5, num_tokens=N,
                                   cache=cache, return_probs=True)
    assert probs.shape == (3, N, model.config.vocab_size) and probs.dtype == torch.float32
    assert torch.allclose(probs.sum(-1), torch.ones(3, N), atol=1e-5)
    assert ((probs > 0).sum(-1) <= 50).all()
    assert (probs.gather(-1, tokens[..., None]) > 0).all()
    assert cache.lengths[:6] == [model.config.cls_token_num + N - 1] * 6
    # a used cache gives the same result as a fresh one
    again = generate_cloud(model, *cond, params, 5, num_tokens=N, cache=cache)
    assert torch.equal(again, tokens)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batch_rows_are_independent_of_each_other(model, cond, temperature):
    """Row b of a batch seeded s is the same caption alone at seed s + b (image b of a request runs at seed + b),
    and per-row seeds give the same rows."""
    params = SamplingParams(cfg_scale=3.0, temperature=temperature)
    batch = generate_cloud(model, *cond, params, 11, num_tokens=N)
    alone = generate_cloud(model, cond[0][1:2], cond[1][1:2], params, 12, num_tokens=N)
    assert torch.equal(batch[1:2], alone)
    assert torch.equal(generate_cloud(model, *cond, params, [11, 12, 13], num_tokens=N), batch)


def test_arguments_are_checked_and_mode_restored(model, cond):
    params = SamplingParams()
    with pytest.raises(ValueError, match="num_tokens"):
        generate_cloud(model, *cond, params, 0, num_tokens=0)
    with pytest.raises(ValueError, match="num_tokens"):
        generate_cloud(model, *cond, params, 0, num_tokens=model.config.block_size + 1)
    with pytest.raises(TypeError, match="seed"):
        generate_cloud(model, *cond, params, torch.Generator(), num_tokens=2)
    with pytest.raises(ValueError, match="seeds"):
        generate_cloud(model, *cond, params, [1, 2], num_tokens=2)
    with pytest.raises(ValueError, match="slots"):
        generate_cloud(model, *cond, SamplingParams(cfg_scale=2.0), 0, num_tokens=2,
                       cache=model.new_cache(4))
    model.train()
    try:
        out = generate_cloud(model, *cond, params, 0, num_tokens=2)
        assert out.shape == (3, 2) and model.training
    finally:
        model.eval()


@pytest.mark.gpu
def test_cuda_generation_matches_cpu_greedy_and_replays(model, cond):
    gpu = build_gpt(model.config).cuda().eval()
    gpu.load_state_dict(model.state_dict())
    greedy = SamplingParams(cfg_scale=3.0, temperature=0.0)
    cpu_tokens = generate_cloud(model, *cond, greedy, 0, num_tokens=N)
    gpu_tokens = generate_cloud(gpu, *cond, greedy, 0, num_tokens=N)
    assert torch.equal(cpu_tokens, gpu_tokens.cpu())
    params = SamplingParams(cfg_scale=3.0, top_k=100)
    a, b = (generate_cloud(gpu, *cond, params, 1, num_tokens=N) for _ in range(2))
    assert a.device.type == "cuda" and torch.equal(a, b)
