"""Training pipelines are seeded and resumable: an interrupted run ends bit-identical to an uninterrupted one."""

import json

import pytest
import torch

from ciar.models.checkpoint import read_model_file, save_model
from ciar.models.vq import build_vq
from pipelines import train_cloud, train_tokenizer


def _weights(path):
    return read_model_file(path)[0]


def test_tokenizer_resume_is_exact(tmp_path):
    common = ["--steps", "4", "--batch-size", "4", "--ckpt-every", "1", "--restart-every", "2", "--threads", "1"]
    train_tokenizer.main(common + ["--out", str(tmp_path / "a"), "--ckpt-dir", str(tmp_path / "ca")])
    # the same run interrupted after 3 steps (between dead-code restarts' windows), then resumed
    b = common + ["--out", str(tmp_path / "b"), "--ckpt-dir", str(tmp_path / "cb")]
    train_tokenizer.main(b + ["--stop-after", "3"])
    assert torch.load(tmp_path / "cb" / "state.pt", weights_only=False)["step"] == 3
    train_tokenizer.main(b)
    state = torch.load(tmp_path / "cb" / "state.pt", weights_only=False)
    assert state["step"] == 4
    a, b = _weights(tmp_path / "a" / "tokenizer.safetensors"), _weights(tmp_path / "b" / "tokenizer.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    metrics = json.load(open(tmp_path / "a" / "tokenizer.metrics.json"))
    assert metrics["codebook_size"] == 1024 and metrics["psnr_db"] > 0
    # (--stop-after differed above: where and how often may change on resume; what the run computes may not)
    from pipelines.common import SettingsMismatch

    with pytest.raises(SettingsMismatch, match=r"the checkpoint in .*cb was made with other settings \(batch_size: "
                                               r"4 there, 8 now; lr: 0.001 there, 0.002 now\)"):
        train_tokenizer.main(common + ["--out", str(tmp_path / "b"), "--ckpt-dir", str(tmp_path / "cb"),
                                       "--batch-size", "8", "--lr", "2e-3"])
    assert torch.load(tmp_path / "cb" / "state.pt", weights_only=False)["step"] == 4


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    torch.manual_seed(0)
    vq = build_vq("scenes-small")
    save_model(vq, str(d / "tokenizer.safetensors"), vq.config.to_dict(), kind="vq")
    return d


def _run_cloud(out, ckpt, data, steps, stop_after=0, extra=()):
    args = ["--out", str(out), "--num-train", "32", "--num-val", "8", "--steps", str(steps), "--batch-size", "4",
            "--ckpt-every", "1", "--eval-every", "2", "--export-every", "100", "--data-dir", str(data),
            "--ckpt-dir", str(ckpt), "--threads", "1", "--set", "n_layer=2", "--set", "dim=64", "--set", "n_head=4",
            "--stop-after", str(stop_after), *extra]
    return train_cloud.main(args)


def test_cloud_resume_is_exact(tmp_path, tokenizer_dir):
    import shutil

    for name in ("a", "b"):
        shutil.copytree(tokenizer_dir, tmp_path / name)
    data = tmp_path / "data"
    _run_cloud(tmp_path / "a", tmp_path / "ca", data, steps=4)
    _run_cloud(tmp_path / "b", tmp_path / "cb", data, steps=4, stop_after=3)  # interrupted ...
    assert torch.load(tmp_path / "cb" / "state.pt", weights_only=False)["step"] == 3
    _run_cloud(tmp_path / "b", tmp_path / "cb", data, steps=4)  # ... and resumed
    a, b = _weights(tmp_path / "a" / "cloud.safetensors"), _weights(tmp_path / "b" / "cloud.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    meta = read_model_file(str(tmp_path / "a" / "cloud.safetensors"))
    assert meta[1] == "gpt" and meta[2]["n_layer"] == 2 and "sampling" in meta[3]


def test_cloud_init_starts_a_new_run_from_an_export(tmp_path, tokenizer_dir):
    import shutil

    for name in ("a", "b"):
        shutil.copytree(tokenizer_dir, tmp_path / name)
    data = tmp_path / "data"
    _run_cloud(tmp_path / "a", tmp_path / "ca", data, steps=2)
    first = str(tmp_path / "a" / "cloud.safetensors")
    # a new run (own checkpoint dir) from that export: step 0 of the new run starts from its weights
    _run_cloud(tmp_path / "b", tmp_path / "cb", data, steps=1, extra=["--init", first, "--lr", "0"])
    a, b = _weights(first), _weights(str(tmp_path / "b" / "cloud.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # lr 0: the weights are the init's
    extra = read_model_file(str(tmp_path / "b" / "cloud.safetensors"))[3]
    assert extra["init"]["steps"] == 2 and extra["init"]["file"].endswith("cloud.safetensors")
    # interrupted and resumed: the resumed run's exports still name the init and its steps
    init_args = ["--init", first]
    _run_cloud(tmp_path / "b", tmp_path / "cr", data, steps=2, stop_after=1, extra=init_args)
    _run_cloud(tmp_path / "b", tmp_path / "cr", data, steps=2, extra=init_args)
    assert read_model_file(str(tmp_path / "b" / "cloud.safetensors"))[3]["init"]["steps"] == 2
    # a file of another config is refused with both configs named
    with pytest.raises(SystemExit, match="config differs"):
        _run_cloud(tmp_path / "b", tmp_path / "cc", data, steps=1, extra=["--init", first, "--set", "n_layer=3"])


def _run_device(world, out_name, ckpt, data, steps, stop_after=0, extra=()):
    from pipelines import train_device

    args = ["--out", str(world), "--name", out_name, "--num-train", "8", "--num-val", "4", "--eval-n", "4",
            "--steps", str(steps), "--batch-size", "2", "--ckpt-every", "1", "--eval-every", "2", "--data-dir",
            str(data), "--ckpt-dir", str(ckpt), "--threads", "1", "--stop-after", str(stop_after), *extra]
    return train_device.main(args)


def test_device_distillation_on_policy_resumes_exactly(tmp_path, shipped_world_copy):
    """On-policy sequences from the real cloud, the teacher cache filled on first use, and an interrupted run that
    ends bit-identical to an uninterrupted one; the metrics hold the gates' AUROCs under the deployed CFG."""
    data = tmp_path / "data"
    _run_device(shipped_world_copy, "a", tmp_path / "ca", data, steps=3)
    _run_device(shipped_world_copy, "b", tmp_path / "cb", data, steps=3, stop_after=2)
    assert torch.load(tmp_path / "cb" / "state.pt", weights_only=False)["step"] == 2
    _run_device(shipped_world_copy, "b", tmp_path / "cb", data, steps=3)
    a = _weights(shipped_world_copy / "a.safetensors")
    b = _weights(shipped_world_copy / "b.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    hist = json.load(open(shipped_world_copy / "a.metrics.json"))["history"]
    last = hist[-1]
    assert set(last["auroc_rejection"]) >= {"interval", "lower", "entropy", "softmax"}
    assert 0 < last["top1_agreement"] <= 1 and last["val_kl_guided"] > 0
    extra = read_model_file(str(shipped_world_copy / "a.safetensors"))[3]
    assert extra["data"] == "onpolicy" and extra["objective"] == "coverage" and extra["sampling"]["cfg_scale"] > 1
    # the on-policy sequences are the cloud's own samples: the same file serves both runs
    import glob

    files = sorted(glob.glob(str(data / "onpolicy" / "train_8_*")))
    assert [f.rsplit("_", 1)[-1].split(".", 1)[1] for f in files] == ["done", "npy", "seed.json",
                                                                        "teacher.filled.npy", "teacher.npy"]
    # a run of another seed into the same --data-dir is refused: the arrays are named by split and size only, so it
    # took this seed's captions and resumed into its on-policy rows (a "replicate" on the same data)
    from pipelines.common import SettingsMismatch, run_main

    with pytest.raises(SettingsMismatch, match=r"the train split of 8 was made with other settings \(seed: 3 there, "
                                               r"4 now\): give another --data-dir"):
        _run_device(shipped_world_copy, "c", tmp_path / "cc", data, steps=1, extra=["--seed", "4"])
    assert run_main(lambda: _run_device(shipped_world_copy, "c", tmp_path / "cc", data, steps=1,
                                        extra=["--seed", "4"])) == 2


def test_on_policy_rows_of_another_seed_or_chunk_are_refused(tmp_path):
    """The on-policy file is named by the cloud and its sampling: another seed (or chunk) would resume into it."""
    from types import SimpleNamespace

    from ciar.decoding.sampling import SamplingParams
    from pipelines.common import SettingsMismatch
    from pipelines.onpolicy import OnPolicyTokens, build_onpolicy

    caps = SimpleNamespace(n=4, emb=None, mask=None)
    cloud = SimpleNamespace(config=SimpleNamespace(block_size=3))
    root = str(tmp_path / "onpolicy")
    # STAND-IN captions and cloud: nothing is sampled, the rows are marked done before the call
    OnPolicyTokens(root, "train", 4, 3, "tag").mark(4)
    build_onpolicy(root, "train", caps, cloud, SamplingParams(), 3, "tag", progress=False)  # records seed 3
    for seed, chunk, named in ((4, 32, "seed: 3 there, 4 now"), (3, 16, "chunk: 32 there, 16 now")):
        with pytest.raises(SettingsMismatch, match=named):
            build_onpolicy(root, "train", caps, cloud, SamplingParams(), seed, "tag", chunk=chunk, progress=False)


def test_device_inter_dro_objective_and_eval_only(tmp_path, shipped_world_copy):
    from pipelines import train_device

    data = tmp_path / "data"
    _run_device(shipped_world_copy, "d", tmp_path / "cd", data, steps=1,
                extra=["--objective", "inter-dro", "--ablate", "lower"])
    out = tmp_path / "auroc.json"
    train_device.main(["--out", str(shipped_world_copy), "--eval-only", str(shipped_world_copy / "d.safetensors"),
                       "--eval-split", "val", "--eval-n", "4", "--num-val", "4", "--data-dir", str(data),
                       "--threads", "1", "--eval-out", str(out)])
    res = json.load(open(out))
    assert res["split"] == "val" and "lower" in res["auroc_disagreement"]
    with pytest.raises(ValueError, match="unknown term"):
        train_device.distill_config("coverage", ["nope"])


def test_projector_trains_on_guided_features_of_a_device(tmp_path, shipped_world_copy):
    """The projector pipeline on the real cloud and a device file: on-policy sequences, guided features, a file
    with standardised inputs and both validation figures."""
    import shutil

    from ciar.collab.projector import IntervalProjector
    from ciar.world import DEFAULT_WEIGHTS_DIR
    from pipelines import train_projector

    world = tmp_path / "w"
    shutil.copytree(shipped_world_copy, world)
    shutil.copy(f"{DEFAULT_WEIGHTS_DIR}/device.safetensors", world / "device.safetensors")
    assert train_projector.main(["--out", str(world), "--steps", "1", "--batch-size", "2", "--num-train", "8",
                                 "--num-val", "4", "--data-dir", str(tmp_path / "data"), "--ckpt-dir",
                                 str(tmp_path / "ck"), "--threads", "1"]) == 0
    proj = IntervalProjector.load(str(world / "projector.safetensors"))
    assert proj.config.standardize
    m = json.load(open(world / "projector.metrics.json"))
    assert m["val_ce_with_projector"] > 0 and m["val_ce_without_projector"] > 0


@pytest.mark.parametrize("flag,value,says", [("--batch-size", "0", "--batch-size must be >= 1, got 0"),
                                             ("--steps", "0", "--steps must be >= 1"),
                                             ("--lr", "-1", "--lr must be >= 0"),
                                             ("--ckpt-every", "0", "--ckpt-every must be >= 1"),
                                             ("--seed", "-1", "--seed must be >= 0")])
def test_the_trainers_shared_counts_are_named_at_the_cli(flag, value, says, tmp_path, capsys):
    """(a --batch-size of 0 was a torch error inside the loop)"""
    with pytest.raises(SystemExit) as e:
        train_tokenizer.main(["--out", str(tmp_path / "o"), "--ckpt-dir", str(tmp_path / "c"), flag, value])
    assert e.value.code == 2 and says in capsys.readouterr().err and not (tmp_path / "c").exists()
