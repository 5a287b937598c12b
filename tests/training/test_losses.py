"""Inter-DRO loss terms, ablations and DRO weighting."""

import pytest
import torch
import torch.nn.functional as F

from ciar.training.losses import LOSS_TERMS, InterDROConfig, inter_dro_loss


def _batch(m=12, v=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(m, v, generator=g, requires_grad=True)
    r = F.softplus(torch.randn(m, v, generator=g)).requires_grad_()
    y = torch.randint(0, v, (m,), generator=g)
    q = torch.softmax(torch.randn(m, v, generator=g), -1)
    return c, r, y, q


def test_terms_match_their_definitions():
    c, r, y, q = _batch()
    cfg = InterDROConfig(dro_eta=1e9)  # eta -> inf: the DRO weights become uniform
    total, parts = inter_dro_loss(c, r, y, q, cfg)
    ce = lambda x: F.cross_entropy(x, y).item()  # noqa: E731
    kl = (q * (q.log() - torch.log_softmax(c, -1))).sum(-1).mean().item()
    assert parts["anchor"] == pytest.approx(ce(c - r) + ce(c + r) + ce(c), rel=1e-5)
    assert parts["lower"] == pytest.approx(ce(c - r), rel=1e-5)
    assert parts["center"] == pytest.approx(ce(c) + kl, rel=1e-5)
    assert parts["upper"] == pytest.approx(ce(c + r), rel=1e-5)
    assert total.item() == pytest.approx(sum(parts[t] for t in LOSS_TERMS), rel=1e-5)
    total.backward()
    assert c.grad is not None and r.grad is not None and torch.isfinite(r.grad).all()


def test_dro_weights_emphasise_hard_rows():
    c, r, y, q = _batch()
    _, sharp = inter_dro_loss(c, r, y, q, InterDROConfig(dro_eta=0.05))
    _, flat = inter_dro_loss(c, r, y, q, InterDROConfig(dro_eta=1e9))
    hardest = F.cross_entropy(c - r, y, reduction="none").max().item()
    assert flat["lower"] < sharp["lower"] <= hardest + 1e-5


@pytest.mark.parametrize("term", LOSS_TERMS)
def test_each_term_can_be_ablated(term):
    c, r, y, q = _batch()
    full, parts = inter_dro_loss(c, r, y, q, InterDROConfig())
    ablated, _ = inter_dro_loss(c, r, y, q, InterDROConfig().ablate(term))
    assert ablated.item() == pytest.approx(full.item() - parts[term], rel=1e-5)


def test_radius_gradient_directions():
    """The lower bound pulls the label's radius down, the upper bound pushes it up."""
    c, r, y, q = _batch()
    for term, sign in (("lower", 1), ("upper", -1)):
        r_ = r.detach().clone().requires_grad_()
        only = InterDROConfig(**{t: float(t == term) for t in LOSS_TERMS})
        inter_dro_loss(c.detach(), r_, y, None, only)[0].backward()
        g_label = r_.grad.gather(1, y[:, None])
        assert (sign * g_label > 0).all()


def test_ignore_index_and_validation():
    c, r, y, q = _batch()
    y2 = y.clone()
    y2[:6] = -100
    a, _ = inter_dro_loss(c, r, y2, q, InterDROConfig(dro_eta=1e9))
    b, _ = inter_dro_loss(c[6:], r[6:], y[6:], q[6:], InterDROConfig(dro_eta=1e9))
    assert a.item() == pytest.approx(b.item(), rel=1e-5)
    with pytest.raises(ValueError):
        InterDROConfig().ablate("kl")
    with pytest.raises(ValueError):
        InterDROConfig(dro_eta=0)
    with pytest.raises(ValueError):
        inter_dro_loss(c, r[:, :3], y)


# ---------------------------------------------------------------------------- distillation + coverage


def _fit_radius(center, cloud_logp, width=0.1, steps=800):
    from ciar.training.losses import coverage_loss

    M, V = center.shape
    r = torch.zeros(1, V, requires_grad=True)
    opt = torch.optim.Adam([r], lr=0.02)
    for _ in range(steps):
        loss, parts = coverage_loss(center, r.expand(M, V), cloud_logp, width=width)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return r.detach()[0], parts


def test_coverage_box_follows_the_error_of_tokens_with_mass_and_stays_small_elsewhere():
    """Minimising the coverage loss over a free radius: a device that is right gets a narrow box, a noisy one a
    box that covers most of the cloud's mass, and a token the device over-estimates by 10 nats (the cloud gives it
    ~0) cannot buy a box that would blow up everyone's bounds."""
    g = torch.Generator().manual_seed(0)
    M, V = 4000, 4
    dev_logq = torch.log(torch.tensor([0.45, 0.45, 0.05, 0.05]))
    center = dev_logq.expand(M, V)
    exact, _ = _fit_radius(center, torch.log_softmax(center, -1))
    assert (exact < 0.05).all()
    cloud = dev_logq + torch.randn(M, V, generator=g) * torch.tensor([0.5, 0.5, 0.5, 0.0])
    cloud[:, 3] = dev_logq[3] - 10.0  # over-estimated by the device
    noisy, parts = _fit_radius(center, torch.log_softmax(cloud, -1))
    assert (noisy[:3] > 0.2).all() and (noisy[:3] > 5 * exact[:3]).all()
    assert noisy[3] < 3.0  # far below its 10-nat error
    assert parts["coverage_of_cloud_mass"] > 0.5


def test_coverage_gradient_depends_on_the_cloud_unlike_inter_dro():
    """The radius gradient of Inter-DRO's CE(c+r) + CE(c-r) is label-free; coverage's follows where the device errs."""
    from ciar.training.losses import coverage_loss

    center = torch.tensor([[2.0, 1.0, 0.0]])
    grads = []
    for cloud in ([2.0, 1.0, 0.0], [0.0, 1.0, 2.0]):  # the device right, then wrong
        r = torch.full((1, 3), 0.5, requires_grad=True)
        coverage_loss(center, r, torch.log_softmax(torch.tensor([cloud]), -1))[0].backward()
        grads.append(r.grad.clone())
    assert (grads[0] > 0).all()  # right everywhere: shrink every radius
    assert grads[1][0, 0] < 0 and grads[1][0, 2] < 0  # wrong on tokens 0 and 2: widen them


def test_distill_loss_is_zero_kl_at_the_cloud_and_follows_cfg():
    from ciar.training.losses import DistillConfig, distill_loss, guided_logp, truncate
    from ciar.decoding.sampling import SamplingParams, logits_to_probs

    g = torch.Generator().manual_seed(1)
    M, V = 5, 7
    lc = torch.randn(2, M, V, generator=g)
    params = SamplingParams(cfg_scale=1.5, temperature=0.8, top_k=4)
    logp = guided_logp(lc[0], lc[1], params)
    assert torch.allclose(truncate(logp, params), logits_to_probs(lc[0], params, uncond_logits=lc[1]), atol=1e-6)
    # a device whose rows equal the cloud's has zero KL (no truncation: with top-k the KL to the truncated cloud
    # also asks the device to keep its mass inside the cloud's top-k) and full agreement
    params = SamplingParams(cfg_scale=1.5, temperature=0.8)
    logp = guided_logp(lc[0], lc[1], params)
    loss, parts = distill_loss(lc.clone(), torch.full((2, M, V), 0.3), logp, params)
    assert parts["kl"] < 1e-5 and parts["agree"] == 1.0 and parts["tv"] < 1e-5
    off, parts_off = distill_loss(lc.flip(-1), torch.full((2, M, V), 0.3), logp, params)
    assert parts_off["kl"] > 0.1 and off > loss
    with pytest.raises(ValueError, match="cond_kl"):
        distill_loss(lc, torch.zeros(2, M, V), logp, params, config=DistillConfig(cond_kl=1.0))
    with pytest.raises(ValueError):
        DistillConfig(coverage_width=-1.0)
    assert DistillConfig().ablate("coverage").coverage == 0.0
