"""Train the default world's measuring instruments: the attribute probe and the FID feature network.

    python -m pipelines.train_probes --out weights/scenes-v1 --steps 800 --batch-size 64 --seed 0 --threads 1

Both networks train on the "probe" split (every shape/colour/size/position/background combination), rendered
on the fly: at step s the probe sees probe-split scenes s*B .. s*B+B-1 of scene seed `seed`, the FID feature
network those of scene seed `seed + 1` (its own data stream and its own init seed). The probe gets light
augmentation (noise, colour offsets, mild blur) so it reads attributes and not rendering artefacts. The FID
network learns content (the same per-cell targets) and, on half of its images, which mild degradation they
went through (blur, noise, colour shift, resampling, posterisation), so its features respond to rendering
quality as well as content. Augmentation randomness is derived from (seed, step), so a resumed run ends
bit-identical to an uninterrupted one.

Writes `OUT/probe.safetensors`, `OUT/fid_features.safetensors` (config in the metadata) and
`OUT/probe.metrics.json`: probe accuracy on 500 rendered held-out references (split "heldout", seed 0) and on
500 val scenes, and FID sanity checks: two disjoint held-out reference sets (the finite-sample floor) against
references vs mildly corrupted references (blur, colour shift, noise, and two kinds never trained on: JPEG and
swapped 4x4 patches), which should be clearly larger. Training state for resuming lives in `--ckpt-dir`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torchmetrics.image.fid import FrechetInceptionDistance
from tqdm import tqdm

from ciar.data import scenes
from ciar.metrics.fid import (DEGRADATIONS, FEATURES_KIND, FeatureNetConfig, SceneFeatureNet, count_targets,
                              fid_between)
from ciar.metrics.probe import (PROBE_KIND, AttributeProbe, ProbeConfig, accuracy_from_predictions, attribute_accuracy,
                                probe_loss, scene_targets)
from ciar.models.checkpoint import save_model
from pipelines.common import (claim_run, cosine_lr, load_training_state, save_training_state, seed_everything, set_lr,
                              setup, training_arguments)


def render_batch(split: str, start: int, n: int, seed: int, device) -> tuple[torch.Tensor, dict]:
    """uint8 images [n, 3, 48, 48] on `device` and their per-cell targets."""
    images, sc = scenes.batch(split, start, n, seed)
    x = torch.as_tensor(images).permute(0, 3, 1, 2).contiguous().to(device)
    return x, {k: v.to(device) for k, v in scene_targets(sc).items()}


def gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of float images [B, C, H, W] (reflect padding)."""
    r = max(1, int(round(3 * sigma)))
    t = torch.arange(-r, r + 1, dtype=x.dtype, device=x.device)
    k = torch.exp(-0.5 * (t / sigma) ** 2)
    k = k / k.sum()
    c = x.shape[1]
    x = F.pad(x, (r, r, r, r), mode="reflect")
    x = F.conv2d(x, k.view(1, 1, 1, -1).repeat(c, 1, 1, 1), groups=c)
    return F.conv2d(x, k.view(1, 1, -1, 1).repeat(c, 1, 1, 1), groups=c)


def augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Light, label-preserving augmentation for the probe (x in [-1, 1])."""
    b = x.shape[0]
    u = lambda *shape: torch.rand(*shape, generator=g).to(x.device)  # noqa: E731
    blur = u(b) < 0.3
    if blur.any():
        x = torch.where(blur.view(b, 1, 1, 1), gaussian_blur(x, 0.6), x)
    x = x + (u(b, 3, 1, 1) - 0.5) * 0.12  # per-channel offset, about +-8 grey levels
    x = x + torch.randn(x.shape, generator=g).to(x.device) * (u(b, 1, 1, 1) * 0.05)
    return x.clamp(-1, 1)


def degrade(images: torch.Tensor, g: torch.Generator, p_clean: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Random mild degradations for training the FID network: uint8 [B, 3, H, W] -> (uint8 images, labels [B])
    with labels indexing `ciar.metrics.fid.DEGRADATIONS` (0 = clean). Content is unchanged."""
    b, _, h, w = images.shape
    u = lambda: float(torch.rand((), generator=g))  # noqa: E731
    x = images.float()
    labels = torch.zeros(b, dtype=torch.long)
    out = []
    for i in range(b):
        xi = x[i:i + 1]
        kind = 0 if u() < p_clean else 1 + int(torch.randint(len(DEGRADATIONS) - 1, (), generator=g))
        if kind == 1:  # blur
            xi = gaussian_blur(xi, 0.4 + 0.8 * u())
        elif kind == 2:  # noise, 3..12 grey levels
            xi = xi + torch.randn(xi.shape, generator=g).to(xi.device) * (3 + 9 * u())
        elif kind == 3:  # colour shift, 4..24 grey levels per channel, random signs
            mag = 4 + 20 * torch.rand(3, generator=g)
            sign = torch.randint(2, (3,), generator=g) * 2 - 1
            xi = xi + (mag * sign).view(1, 3, 1, 1).to(xi.device)
        elif kind == 4:  # down- and up-sampling
            f = (1.5, 2.0, 3.0)[int(torch.randint(3, (), generator=g))]
            small = F.interpolate(xi, size=(int(h / f), int(w / f)), mode="bilinear", antialias=True)
            xi = F.interpolate(small, size=(h, w), mode="bilinear", align_corners=False)
        elif kind == 5:  # posterise to 3..5 bits per channel
            step = 256 / 2 ** (3 + int(torch.randint(3, (), generator=g)))
            xi = (torch.floor(xi / step) + 0.5) * step
        labels[i] = kind
        out.append(xi)
    return torch.cat(out).round().clamp(0, 255).to(torch.uint8), labels.to(images.device)


# corruptions for the FID sanity checks (numpy uint8 [N, H, W, 3] in and out)
def corrupt_blur(images: np.ndarray, sigma: float = 0.8) -> np.ndarray:
    x = torch.as_tensor(images).permute(0, 3, 1, 2).float()
    y = gaussian_blur(x, sigma).round().clamp(0, 255).to(torch.uint8)
    return y.permute(0, 2, 3, 1).numpy()


def corrupt_color(images: np.ndarray, shift=(12, 0, -12)) -> np.ndarray:
    return np.clip(images.astype(np.int16) + np.array(shift, np.int16), 0, 255).astype(np.uint8)


def corrupt_noise(images: np.ndarray, sigma: float = 4.0, seed: int = 0) -> np.ndarray:
    noise = np.random.default_rng(seed).normal(0.0, sigma, images.shape)
    return np.clip(np.rint(images + noise), 0, 255).astype(np.uint8)


def corrupt_jpeg(images: np.ndarray, quality: int = 75) -> np.ndarray:
    """JPEG round trip (not a training degradation: a held-out kind of artefact)."""
    import io

    from PIL import Image

    out = []
    for im in images:
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, format="JPEG", quality=quality)
        out.append(np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB")))
    return np.stack(out)


def corrupt_patches(images: np.ndarray, k: int = 4, patch: int = 4, seed: int = 0) -> np.ndarray:
    """Copy `k` random patch x patch blocks of each image over other random places of it, like wrong VQ tokens
    (not a training degradation: a held-out kind of artefact)."""
    rng = np.random.default_rng(seed)
    out = images.copy()
    n, h, w, _ = images.shape
    for i in range(n):
        for _ in range(k):
            sy, sx, dy, dx = rng.integers(0, h - patch + 1, size=4)
            out[i, dy:dy + patch, dx:dx + patch] = images[i, sy:sy + patch, sx:sx + patch]
    return out


@torch.no_grad()
def feature_net_accuracy(net: SceneFeatureNet, images: np.ndarray, sc) -> dict:
    """The FID network's own classification accuracy (same report as the probe's), for the model card."""
    was = net.training
    net.eval()
    preds = {k: [] for k in ("shape", "color", "size", "background")}
    for s in range(0, len(images), 256):
        logits = net.classify(images[s:s + 256])
        for k in preds:
            preds[k].append(logits[k].argmax(-1).cpu())
    net.train(was)
    return accuracy_from_predictions({k: torch.cat(v) for k, v in preds.items()}, scene_targets(sc))


def evaluate(probe, net, n: int = 500, seed: int = 0) -> dict:
    probe.eval()
    net.eval()
    refs, sc = scenes.batch("heldout", 0, n, seed)
    refs2, _ = scenes.batch("heldout", n, n, seed)  # disjoint second reference set
    val, val_sc = scenes.batch("val", 0, n, seed)
    out = {
        "probe_heldout": attribute_accuracy(probe, refs, sc),
        "probe_val": attribute_accuracy(probe, val, val_sc),
        "probe_heldout_blurred": attribute_accuracy(probe, corrupt_blur(refs), sc),
        "fid_net_heldout": feature_net_accuracy(net, refs, sc),
    }
    with torch.no_grad():
        deg, labels = degrade(torch.as_tensor(refs).permute(0, 3, 1, 2), torch.Generator().manual_seed(12345))
        pred = net.classify(deg)["degradation"].argmax(-1)
    out["fid_net_heldout"]["degradation_accuracy"] = float((pred == labels).float().mean())
    frozen = SceneFeatureNet(net.config)  # the same as make_fid("scenes", OUT/fid_features.safetensors)
    frozen.load_state_dict(net.state_dict())
    fid = FrechetInceptionDistance(feature=frozen.cpu().freeze(), normalize=False, reset_real_features=True)
    corrupted = {
        "blurred_sigma0.5": corrupt_blur(refs2, 0.5),
        "blurred_sigma0.8": corrupt_blur(refs2, 0.8),
        "color_shift_12": corrupt_color(refs2),
        "noise_sigma4": corrupt_noise(refs2, 4.0),
        "jpeg_q75": corrupt_jpeg(refs2, 75),
        "patch_swaps_4": corrupt_patches(refs2),
    }
    out["fid"] = {"n_per_set": n, "heldout_vs_heldout_disjoint": fid_between(fid, refs, refs2),
                  "heldout_vs_itself": fid_between(fid, refs, refs)}
    for name, imgs in corrupted.items():
        out["fid"][f"heldout_vs_{name}"] = fid_between(fid, refs, imgs)
    # content shifts: the second reference set re-rendered with its objects altered
    sc2 = [scenes.scene_at("heldout", i, seed) for i in range(n, 2 * n)]
    rng = np.random.default_rng(seed)
    edits = {
        "all_circles": lambda s: [dataclasses.replace(o, shape="circle") for o in s.objects],
        "first_object_only": lambda s: list(s.objects[:1]),
        "random_colors": lambda s: [dataclasses.replace(o, color=scenes.COLOR_NAMES[rng.integers(len(scenes.COLORS))])
                                    for o in s.objects],
    }
    for name, edit in edits.items():
        imgs = np.stack([scenes.render(scenes.Scene(tuple(edit(s)), s.background)) for s in sc2])
        out["fid"][f"heldout_vs_{name}"] = fid_between(fid, refs, imgs)
    out["fid"]["heldout_vs_val"] = fid_between(fid, refs, val)
    return out


def main(argv=None) -> int:
    p = training_arguments("python -m pipelines.train_probes", __doc__, out="weights/scenes-v1", steps=800,
                           batch_size=64, lr=2e-3, warmup=50, seed=0, ckpt_dir="runs/probes", ckpt_every=100)
    p.add_argument("--eval-n", type=int, default=500, help="rendered references per evaluation set")
    args = p.parse_args(argv)
    device = setup(args)

    probe = AttributeProbe(ProbeConfig()).to(device)
    torch.manual_seed(args.seed + 1)  # the FID network: its own init seed
    net = SceneFeatureNet(FeatureNetConfig()).to(device)
    seed_everything(args.seed)
    opt_p = torch.optim.AdamW(probe.parameters(), lr=args.lr, weight_decay=1e-4)
    opt_f = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)
    claim_run(args.ckpt_dir, args)
    ckpt = os.path.join(args.ckpt_dir, "state.pt")
    start = load_training_state(ckpt, probe=probe, fid_net=net, opt_probe=opt_p, opt_fid=opt_f)
    if start:
        print(f"resuming from step {start}")
    probe.train()
    net.train()
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="probes", dynamic_ncols=True)
    t0 = time.time()
    B = args.batch_size
    for step in bar:
        lr = cosine_lr(step, args.steps, args.lr, warmup=args.warmup, final_frac=0.02)
        set_lr(opt_p, lr)
        set_lr(opt_f, lr)
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        x, t = render_batch("probe", step * B, B, args.seed, device)
        loss_p = probe_loss(probe(augment(x.float().div(127.5).sub(1.0), g)), t)
        opt_p.zero_grad(set_to_none=True)
        loss_p.backward()
        opt_p.step()
        x, t = render_batch("probe", step * B, B, args.seed + 1, device)
        g = torch.Generator().manual_seed((args.seed + 1) * 1_000_003 + step)
        x, t["degradation"] = degrade(x, g)
        logits = net.classify(x)  # uint8 input, exactly what FrechetInceptionDistance.update passes
        counts = count_targets(t["shape"], t["color"], t["size"], t["background"])
        loss_f = (probe_loss(logits, t) + F.cross_entropy(logits["degradation"], t["degradation"])
                  + F.mse_loss(logits["counts"], counts))
        opt_f.zero_grad(set_to_none=True)
        loss_f.backward()
        opt_f.step()
        if step % 10 == 0:
            bar.set_postfix(probe=f"{loss_p.item():.4f}", fid_net=f"{loss_f.item():.4f}", lr=f"{lr:.2e}")
        stopping = args.stop_after and step + 1 - start >= args.stop_after
        if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps or stopping:
            save_training_state(ckpt, step + 1, probe=probe, fid_net=net, opt_probe=opt_p, opt_fid=opt_f)
        if stopping:
            print(f"stopped after step {step + 1}; run again to resume")
            return 0
    train_seconds = time.time() - t0
    probe.cpu()
    net.cpu()
    metrics = evaluate(probe, net, n=args.eval_n, seed=0)
    metrics.update(steps=args.steps, batch_size=B, lr=args.lr, seed=args.seed, device=str(device),
                   train_seconds_this_run=train_seconds)
    print(json.dumps({"probe_heldout": metrics["probe_heldout"]["attribute_accuracy"],
                      "probe_val": metrics["probe_val"]["attribute_accuracy"], "fid": metrics["fid"]}))
    os.makedirs(args.out, exist_ok=True)
    common = {"steps": args.steps, "batch_size": B, "seed": args.seed, "split": "probe"}
    save_model(probe, os.path.join(args.out, "probe.safetensors"), probe.config.to_dict(), kind=PROBE_KIND,
               extra=dict(common, heldout_attribute_accuracy=metrics["probe_heldout"]["attribute_accuracy"]))
    save_model(net, os.path.join(args.out, "fid_features.safetensors"), net.config.to_dict(), kind=FEATURES_KIND,
               extra=dict(common, data_seed=args.seed + 1, init_seed=args.seed + 1))
    with open(os.path.join(args.out, "probe.metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
