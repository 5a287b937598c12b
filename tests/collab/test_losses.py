"""Inter-DRO loss terms, ablations and DRO weighting."""

import pytest
import torch
import torch.nn.functional as F

from ciar.collab.losses import LOSS_TERMS, InterDROConfig, inter_dro_loss


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
