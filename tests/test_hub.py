"""Hugging Face Hub references in world files (`ciar.hub`, `ciar.world_spec`): `hf://OWNER/REPO[@REVISION][/PATH]`
in any file or folder field, resolved through huggingface_hub's standard cache before anything loads.

No network. `LocalHub` is a local stand-in for the few HTTP endpoints of the Hub that huggingface_hub's download code
calls (a file's HEAD / GET under `resolve/`, a revision's info, a tree listing), serving TINY RANDOM-WEIGHT files in
the real formats (`ciar.testing`). Everything else is real: `python -m ciar.world_spec fetch` downloads through
`hf_hub_download` / `snapshot_download`, so the cache (blobs, snapshots/<commit>/..., refs/main, its tree listings)
is written by huggingface_hub itself, exactly as it writes a real one; the tests then run with HF_HUB_OFFLINE=1 (the
session's setting, tests/conftest.py) on that cache, as an air-gapped cluster does. The no-network case uses a port
nothing listens on."""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import pytest
import torch
import yaml

from ciar.hub import HubError, commit_of, is_ref, parse_ref, transformers_missing
from ciar.testing import (LLAMAGEN_SMALL_GPT, LLAMAGEN_SMALL_VQ, make_tiny_t5, write_llamagen_checkpoints,
                          write_random_anole_files, write_random_llamagen_files)
from ciar.world_spec import AnoleWorldSpec, LlamaGenWorldSpec, WorldSpecError, read_world, spec_dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LFS = (".pt", ".pth", ".ckpt", ".safetensors", ".bin", ".h5", ".msgpack", ".npy", ".png")  # stored as LFS on the Hub


# ---------------------------------------------------------------------------------------------------- LocalHub
def _git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class LocalHub:
    """A local stand-in for the Hub's HTTP endpoints that huggingface_hub's downloads call, NOT the Hub: HEAD / GET
    `[datasets/]OWNER/REPO/resolve/REV/PATH` (X-Repo-Commit, the ETag the Hub gives: an LFS file's sha256, else its
    git blob id), `api/{models,datasets}/OWNER/REPO/revision/REV` and `.../tree/REV` (one page); the Hub's error codes
    (RepoNotFound, RevisionNotFound, EntryNotFound) for the rest. No auth, no xet, no pagination."""

    def __init__(self):
        self.repos: dict = {}  # (repo_type, repo_id) -> {"commits": {sha: {path: bytes}}, "refs": {branch: sha}}
        self.gets: list[str] = []  # the paths of the files served (what was downloaded)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._serve(self, body=False)

            def do_GET(self):
                hub._serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def commit(self, repo_id: str, files: dict, repo_type: str = "model", branch: str = "main") -> str:
        """A new commit on `branch` with `files` ({path: bytes or a local file or folder}) over the branch's files."""
        repo = self.repos.setdefault((repo_type, repo_id), {"commits": {}, "refs": {}})
        tree = dict(repo["commits"].get(repo["refs"].get(branch), {}))
        for path, data in files.items():
            if isinstance(data, str) and os.path.isdir(data):
                for root, _, names in os.walk(data):
                    for n in names:
                        rel = os.path.relpath(os.path.join(root, n), data).replace(os.sep, "/")
                        tree[f"{path}/{rel}" if path else rel] = open(os.path.join(root, n), "rb").read()
            else:
                tree[path] = open(data, "rb").read() if isinstance(data, str) else data
        sha = hashlib.sha1(json.dumps([repo_id, len(repo["commits"]), sorted(
            (p, hashlib.sha256(b).hexdigest()) for p, b in tree.items())]).encode()).hexdigest()
        repo["commits"][sha], repo["refs"][branch] = tree, sha
        return sha

    def stop(self):
        self.server.shutdown()

    def _serve(self, h, body: bool):
        parts = unquote(urlsplit(h.path).path).strip("/").split("/")
        api = parts[0] == "api"
        if api:
            parts = parts[1:]
        repo_type = "model"
        if parts and parts[0] in ("datasets", "models"):
            repo_type, parts = ("dataset" if parts[0] == "datasets" else "model"), parts[1:]
        if len(parts) < 4:
            return self._error(h, 404, "RepoNotFound")
        repo = self.repos.get((repo_type, "/".join(parts[:2])))
        if repo is None:
            return self._error(h, 404, "RepoNotFound")
        action, rev, path = parts[2], parts[3], "/".join(parts[4:])
        sha = repo["refs"].get(rev, rev if rev in repo["commits"] else None)
        if sha is None:
            return self._error(h, 404, "RevisionNotFound")
        tree = repo["commits"][sha]
        if api and action == "revision":
            return self._json(h, {"id": "/".join(parts[:2]), "sha": sha, "siblings": [{"rfilename": p} for p in tree]})
        if api and action == "tree":
            entries = []
            for p, data in sorted(tree.items()):
                e = {"type": "file", "path": p, "size": len(data), "oid": _git_blob(data)}
                if p.endswith(LFS):
                    e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                entries.append(e)
            return self._json(h, entries)
        if action != "resolve" or path not in tree:
            return self._error(h, 404, "EntryNotFound")
        data = tree[path]
        h.send_response(200)
        h.send_header("X-Repo-Commit", sha)
        h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest() if path.endswith(LFS) else _git_blob(data)}"')
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            self.gets.append(f"{'/'.join(parts[:2])}/{path}")
            h.wfile.write(data)

    @staticmethod
    def _json(h, obj):
        data = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    @staticmethod
    def _error(h, status, code):
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", code)
        h.send_header("Content-Length", "0")
        h.end_headers()


def online_env(hf_home, endpoint) -> dict:
    """A child process's environment with the Hub reachable (at `endpoint`) and the cache at `hf_home`."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HOME=str(hf_home), HF_ENDPOINT=endpoint, HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=REPO,
               CIAR_TEST_THREADS="1")
    env.pop("HF_HUB_CACHE", None)
    return env


def run_fetch(world, hf_home, endpoint, *extra):
    return subprocess.run([sys.executable, "-m", "ciar.world_spec", "fetch", str(world), *extra], cwd=REPO,
                          env=online_env(hf_home, endpoint), capture_output=True, text=True, timeout=300)


# ---------------------------------------------------------------------------------------------------- the worlds
@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Tiny LlamaGen, Anole and scenes worlds twice: from local files, and from `hf://` references to LocalHub
    repositories, fetched into a fresh HF_HOME by `python -m ciar.world_spec fetch` (downloads through
    huggingface_hub)."""
    root = tmp_path_factory.mktemp("hub")
    local = root / "local"
    cfg = write_random_llamagen_files(str(local), [1, 2])
    make_tiny_t5(str(local / "flan"), d_model=LLAMAGEN_SMALL_GPT["caption_dim"])
    other = write_llamagen_checkpoints(str(root / "other"), "GPT-B", 16, LLAMAGEN_SMALL_GPT, 64, LLAMAGEN_SMALL_VQ,
                                       seed=1, names=("t2i_small.pt", "vq_small.pt", "device.safetensors"))
    anole = write_random_anole_files(str(root / "anole"))

    h = LocalHub()
    c = {}
    c["t2i"] = h.commit("tiny-org/llamagen-t2i", {"t2i_small.pt": str(local / "t2i_small.pt"),
                                                  "vq_small.pt": str(local / "vq_small.pt"), "README.md": b"tiny"})
    c["t2i_main"] = h.commit("tiny-org/llamagen-t2i", {"t2i_small.pt": other[0]})  # main moves on: another GPT
    # a transformers snapshot, with the copies a real repository carries that no torch loader reads
    c["t5"] = h.commit("tiny-org/flan-t5-tiny", {"": str(local / "flan"), "tf_model.h5": b"tf" * 100,
                                                 "flax_model.msgpack": b"flax" * 100, "README.md": b"card"})
    c["dev"] = h.commit("tiny-org/ciar-device", {"llamagen/device.safetensors": str(local / "device.safetensors")})
    c["coco"] = h.commit("tiny-org/coco-tiny", {"t5": str(local / "t5"), "images": str(local / "images"),
                                                "annotations/captions_train2017.json": b"{}" * 100},
                         repo_type="dataset")
    c["clip"] = h.commit("tiny-org/clip-tiny", {"": str(local / "clip")})
    c["metrics"] = h.commit("tiny-org/metrics", {"inception.pth": str(local / "inception.pth")})
    c["anole_hf"] = h.commit("tiny-org/anole-hf", {"": str(root / "anole" / "anole-hf")})
    c["anole"] = h.commit("tiny-org/anole", {"tokenizer": str(root / "anole" / "tokenizer"),
                                             "models/7b/consolidated.pth": b"not downloaded" * 100})
    c["scenes"] = h.commit("tiny-org/scenes", {n: os.path.join(REPO, "weights", "scenes-v2", n) for n in
                                               ("tokenizer.safetensors", "cloud.safetensors", "README.md")})

    common = {k: cfg[k] for k in ("gpt_config", "gpt_overrides", "image_size", "vq_overrides")}
    common.update(kind="llamagen", sampling={"cfg_scale": 2.0, "top_k": 0})
    local_world = {**common, "gpt_checkpoint": "local/t2i_small.pt", "vq_checkpoint": "local/vq_small.pt",
                   "text_encoder": "local/flan", "device_checkpoint": "local/device.safetensors",
                   "t5_embeddings": "local/t5", "clip_model": "local/clip", "inception_weights": "local/inception.pth",
                   "reference_images": "local/images"}
    hub_world = {**common,
                 "gpt_checkpoint": f"hf://tiny-org/llamagen-t2i@{c['t2i']}/t2i_small.pt",  # a file, pinned
                 "vq_checkpoint": "hf://tiny-org/llamagen-t2i@main/vq_small.pt",  # a file on a branch
                 "text_encoder": "hf://tiny-org/flan-t5-tiny",  # a transformers snapshot, the default branch
                 "device_checkpoint": f"hf://tiny-org/ciar-device@{c['dev']}/llamagen/device.safetensors",
                 "t5_embeddings": f"hf://datasets/tiny-org/coco-tiny@{c['coco']}/t5",  # a folder of a dataset repo
                 "clip_model": f"hf://tiny-org/clip-tiny@{c['clip']}",
                 "inception_weights": f"hf://tiny-org/metrics@{c['metrics']}/inception.pth",
                 "reference_images": f"hf://datasets/tiny-org/coco-tiny@{c['coco']}/images"}
    anole_local = {**anole, **{k: f"anole/{anole[k]}" for k in ("model", "vq_checkpoint", "vq_yaml",
                                                                 "device_checkpoint")}}
    anole_hub = {**anole, "model": f"hf://tiny-org/anole-hf@{c['anole_hf']}",
                 "vq_checkpoint": f"hf://tiny-org/anole@{c['anole']}/tokenizer/vqgan.ckpt",
                 "vq_yaml": f"hf://tiny-org/anole@{c['anole']}/tokenizer/vqgan.yaml",
                 "device_checkpoint": f"anole/{anole['device_checkpoint']}"}  # a local file beside Hub ones
    files = {"local": local_world, "hub": hub_world, "anole-local": anole_local, "anole-hub": anole_hub,
             "moved": {**hub_world, "gpt_checkpoint": "hf://tiny-org/llamagen-t2i@main/t2i_small.pt"},
             "scenes-hub": {"kind": "scenes", "weights": f"hf://tiny-org/scenes@{c['scenes']}"}}
    for name, world in files.items():
        (root / f"{name}.yaml").write_text(yaml.safe_dump(world))
    hf_home = root / "hf"
    fetched = {}
    for name in ("hub", "moved", "anole-hub", "scenes-hub"):
        r = run_fetch(root / f"{name}.yaml", hf_home, h.url, "--json")
        assert r.returncode == 0, r.stderr
        fetched[name] = (json.loads(r.stdout), r.stderr)
    yield {"root": root, "local": local, "hub": h, "commits": c, "hf_home": hf_home, "fetched": fetched,
           "world": {name: str(root / f"{name}.yaml") for name in files}, "other": other}
    h.stop()


@pytest.fixture
def cache(hub, monkeypatch):
    """The fetched cache, read as an air-gapped node reads it: HF_HOME set, HF_HUB_OFFLINE=1."""
    monkeypatch.setenv("HF_HOME", str(hub["hf_home"]))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


# ---------------------------------------------------------------------------------------------------- references
@pytest.mark.parametrize("ref, want", [
    ("hf://peizesun/llamagen_t2i@276f5c5a3d915b922899a03f1912605531574747/vq_ds16_t2i.pt",
     ("peizesun/llamagen_t2i", "276f5c5a3d915b922899a03f1912605531574747", "vq_ds16_t2i.pt", "model")),
    ("hf://google/flan-t5-xl", ("google/flan-t5-xl", None, "", "model")),
    ("hf://GAIR/Anole-7b-v0.1@main/tokenizer/vqgan.yaml", ("GAIR/Anole-7b-v0.1", "main", "tokenizer/vqgan.yaml",
                                                           "model")),
    ("hf://o/r@refs/pr/3/a/b.pt", ("o/r", "refs/pr/3", "a/b.pt", "model")),
    ("hf://datasets/o/coco@v1/images", ("o/coco", "v1", "images", "dataset")),
    ("hf://models/o/r/sub", ("o/r", None, "sub", "model")),
])
def test_references_parse_as_huggingface_hubs_own_uris(ref, want):
    r = parse_ref(ref)
    assert (r.repo_id, r.revision, r.path, r.repo_type) == want and str(r) == ref and is_ref(ref)
    try:
        from huggingface_hub import parse_hf_uri  # the library's own grammar, where it has one (>= 1.x)
    except ImportError:
        return
    u = parse_hf_uri(ref)
    assert (u.id, u.revision, u.path_in_repo, u.type) == want


@pytest.mark.parametrize("ref, message", [
    ("hf://owner", "repository name '' is not valid"),
    ("hf://o/r@/x.pt", "an empty revision"),
    ("hf://o/r/../x.pt", "'.' or '..' segment"),
    ("hf://-o/r/x.pt", "owner '-o' is not valid"),
])
def test_a_malformed_reference_is_named(ref, message):
    with pytest.raises(HubError, match=message):
        parse_ref(ref)
    assert not is_ref("/mnt/models/x.pt") and not is_ref("models/x.pt") and not is_ref(None)


# ---------------------------------------------------------------------------------------------------- fetch
def test_fetch_downloads_every_reference_into_the_standard_cache(hub):
    from huggingface_hub import scan_cache_dir

    out, err = hub["fetched"]["hub"]
    assert "world check: ok" in err
    rows = {r["field"]: r for r in out["files"]}
    assert set(rows) == {"gpt_checkpoint", "vq_checkpoint", "text_encoder", "device_checkpoint", "t5_embeddings",
                         "clip_model", "inception_weights", "reference_images"}
    cache = str(hub["hf_home"] / "hub")
    assert out["cache"] == cache
    local = hub["local"]
    for field, src in (("gpt_checkpoint", "t2i_small.pt"), ("vq_checkpoint", "vq_small.pt"),
                       ("device_checkpoint", "device.safetensors"), ("inception_weights", "inception.pth")):
        r = rows[field]
        assert r["hub"] and r["path"].startswith(cache + os.sep) and filecmp.cmp(r["path"], local / src, False)
        assert r["bytes"] == os.path.getsize(local / src)  # the size printed is the file's
    c = hub["commits"]
    assert rows["gpt_checkpoint"]["commit"] == c["t2i"] and rows["vq_checkpoint"]["commit"] == c["t2i_main"]
    # a transformers snapshot: what a loader reads, not the repository's TensorFlow / Flax copies or its card
    t5 = rows["text_encoder"]["path"]
    assert sorted(os.listdir(t5)) == sorted(os.listdir(local / "flan"))
    assert rows["text_encoder"]["bytes"] == sum(os.path.getsize(local / "flan" / n) for n in os.listdir(local / "flan"))
    assert not any("tf_model.h5" in g or "flax_model" in g for g in hub["hub"].gets)
    assert sorted(os.listdir(rows["t5_embeddings"]["path"])) == sorted(os.listdir(local / "t5"))
    assert not any("annotations" in g for g in hub["hub"].gets)  # a folder of a repository: only that folder
    # the cache is huggingface_hub's own layout: its scanner reads it with no warning
    info = scan_cache_dir(cache)
    assert not info.warnings
    repos = {(r.repo_type, r.repo_id): r for r in info.repos}
    assert ("dataset", "tiny-org/coco-tiny") in repos and ("model", "tiny-org/llamagen-t2i") in repos
    t2i = repos[("model", "tiny-org/llamagen-t2i")]
    assert {r.commit_hash for r in t2i.revisions} == {c["t2i"], c["t2i_main"]}
    assert {ref for r in t2i.revisions for ref in r.refs} == {"main"}
    assert open(os.path.join(cache, "models--tiny-org--llamagen-t2i", "refs", "main")).read() == c["t2i_main"]
    # only the Anole repository's two tokenizer files, not its consolidated 7B checkpoint
    assert not any("consolidated" in g for g in hub["hub"].gets)


def test_fetch_prints_each_files_size_and_lists_local_files(cache, capsys):
    from ciar.hub import human_bytes
    from ciar.world_spec import main

    assert main(["fetch", cache["world"]["anole-hub"], "--cache-only"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    model = next(x for x in lines if x.startswith("model "))
    folder = os.path.join(cache["root"], "anole", "anole-hf")
    size = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
    assert human_bytes(size) in model and f"hf://tiny-org/anole-hf@{cache['commits']['anole_hf']} -> " in model
    device = next(x for x in lines if x.startswith("device_checkpoint"))
    assert " local " in device and "device.safetensors" in device
    assert lines[-1].startswith("3 from the Hub, ") and str(cache["hf_home"] / "hub") in lines[-1]
    assert "world check: ok" in err


# ---------------------------------------------------------------------------------------------------- resolution
def test_every_field_kind_resolves_offline_to_the_local_worlds_files(cache):
    hub_spec, local_spec = read_world(cache["world"]["hub"]), read_world(cache["world"]["local"])
    for field in LlamaGenWorldSpec.FILES + LlamaGenWorldSpec.FOLDERS:
        if getattr(local_spec, field) is None:
            continue
        got, want = hub_spec.path(getattr(hub_spec, field)), local_spec.path(getattr(local_spec, field))
        assert got.startswith(str(cache["hf_home"] / "hub")), field
        if os.path.isfile(want):
            assert filecmp.cmp(got, want, shallow=False), field
        else:
            cmp = filecmp.dircmp(got, want)
            assert not (cmp.left_only or cmp.right_only or cmp.diff_files), field
    # the revision decides: main has moved on to another GPT, the pinned commit has not
    moved = read_world(cache["world"]["moved"])
    assert commit_of(moved.path(moved.gpt_checkpoint)) == cache["commits"]["t2i_main"]
    assert filecmp.cmp(moved.path(moved.gpt_checkpoint), cache["other"][0], shallow=False)
    assert not filecmp.cmp(moved.path(moved.gpt_checkpoint), hub_spec.path(hub_spec.gpt_checkpoint), shallow=False)


def test_reading_a_world_online_downloads_what_the_cache_lacks_before_its_checks(hub, tmp_path):
    """A replica with the Hub reachable and an empty cache: `read_world` (what `load_world` calls) fetches first."""
    script = ("import json, sys\nfrom ciar.world_spec import read_world, spec_dict\n"
              "print(json.dumps(spec_dict(read_world(sys.argv[1], need_device=True, need_text=True))))\n")
    r = subprocess.run([sys.executable, "-c", script, hub["world"]["anole-hub"]], cwd=REPO, capture_output=True,
                       text=True, env=online_env(tmp_path / "hf", hub["hub"].url), timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for field in ("model", "vq_checkpoint", "vq_yaml"):
        assert d[field].startswith(str(tmp_path / "hf" / "hub")) and os.path.exists(d[field]), field


def test_the_hub_world_loads_as_the_local_world(cache):
    from ciar.world import load_world

    hub_w, local_w = load_world(cache["world"]["hub"], need_text=True), load_world(cache["world"]["local"],
                                                                                     need_text=True)
    for a, b in ((hub_w.cloud, local_w.cloud), (hub_w.vq, local_w.vq), (hub_w.device_model, local_w.device_model)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    caps = ["a red bus on a city street", "two dogs in the park"]
    ca, cb = hub_w.text.encode(caps), local_w.text.encode(caps)
    assert torch.equal(ca.emb, cb.emb) and torch.equal(ca.mask, cb.mask)


def test_generate_on_the_hub_world_makes_the_local_worlds_image(cache, tmp_path):
    """Cloud-only decoding: its image depends on the weights and the seed alone (CIAR's default adaptive policy also
    reads the costs it measures, so two CIAR runs on a loaded machine may choose other spans; the device models are
    compared weight for weight above)."""
    from ciar.generate import main

    outs = {}
    for name in ("hub", "local"):
        out = tmp_path / f"{name}.png"
        assert main(["--world", cache["world"][name], "--prompt", "a red bus on a city street", "--method", "cloud",
                     "--seed", "3", "--out", str(out), "--stats", str(tmp_path / f"{name}.json")]) == 0
        outs[name] = out.read_bytes()
    assert outs["hub"] == outs["local"]
    assert json.load(open(tmp_path / "hub.json"))["num_tokens"] == 16


def test_an_anole_world_from_snapshots_is_checked_and_loads_as_the_local_one(cache):
    from ciar.world import load_world

    spec = read_world(cache["world"]["anole-hub"], need_device=True)
    assert isinstance(spec, AnoleWorldSpec) and spec.tokenizer_file().startswith(str(cache["hf_home"]))
    assert spec.gpt_cfg() == read_world(cache["world"]["anole-local"]).gpt_cfg()
    assert spec.describe() == "Anole world anole-hf @ 32px"
    a, b = load_world(spec), load_world(cache["world"]["anole-local"])
    sa, sb = a.cloud.state_dict(), b.cloud.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(a.vq.quantize.embedding.weight, b.vq.quantize.embedding.weight)
    assert a.text.encode(["a red bus"]).emb.equal(b.text.encode(["a red bus"]).emb)


def test_a_scenes_world_takes_its_weights_folder_from_the_hub(cache):
    from ciar.world import load_world

    w = load_world(cache["world"]["scenes-hub"])
    assert w.weights_dir.startswith(str(cache["hf_home"] / "hub")) and w.device_model is None  # not in that repo
    shipped = load_world(None)
    assert torch.equal(w.cloud.output.weight, shipped.cloud.output.weight)


def test_spec_dict_hands_out_cache_paths_or_the_references(cache):
    spec = read_world(cache["world"]["hub"])
    d = spec_dict(spec)
    assert d["gpt_checkpoint"] == spec.path(spec.gpt_checkpoint) and os.path.isfile(d["gpt_checkpoint"])
    assert read_world(d).gpt_checkpoint == d["gpt_checkpoint"]  # a replica on a node that shares the cache
    refs = spec_dict(spec, hub_refs=True)  # a replica that resolves from its own node's cache
    assert refs["text_encoder"] == "hf://tiny-org/flan-t5-tiny" and read_world(refs).path(refs["text_encoder"]) \
        == d["text_encoder"]
    unresolved = spec_dict(read_world(cache["world"]["hub"], check=False))  # nothing resolved: refs stay refs
    assert unresolved["vq_checkpoint"] == "hf://tiny-org/llamagen-t2i@main/vq_small.pt"


# ---------------------------------------------------------------------------------------------------- errors
def _one_line(e) -> str:
    text = str(e.value if hasattr(e, "value") else e)
    assert "\n" not in text and "Traceback" not in text
    return text


def test_offline_a_file_not_in_the_cache_is_one_line_naming_field_repository_file_and_fetch(cache, tmp_path):
    world = yaml.safe_load(open(cache["world"]["hub"]))
    world["gpt_checkpoint"] = f"hf://tiny-org/llamagen-t2i@{cache['commits']['t2i']}/t2i_XL_stage1_256.pt"
    path = tmp_path / "world.yaml"
    path.write_text(yaml.safe_dump(world))
    with pytest.raises(WorldSpecError) as e:
        read_world(str(path))
    text = _one_line(e)
    assert text.startswith(f"{path}: gpt_checkpoint: hf://tiny-org/llamagen-t2i@")
    assert f"t2i_XL_stage1_256.pt of tiny-org/llamagen-t2i@{cache['commits']['t2i'][:12]}" in text
    assert f"is not in the Hugging Face cache {cache['hf_home'] / 'hub'}" in text and "HF_HUB_OFFLINE=1" in text
    assert text.endswith(f"python -m ciar.world_spec fetch {path}")
    # a snapshot never fetched, from a dict (the Serve builder's args): the `hf download` command instead
    with pytest.raises(WorldSpecError) as e:
        read_world({**yaml.safe_load(open(cache["world"]["hub"])), "base_dir": str(cache["root"]),
                    "text_encoder": "hf://google/flan-t5-xl@7d6315df2c2fb742f0f5b556879d730926ca9001"})
    text = _one_line(e)
    assert text.startswith("world: text_encoder: hf://google/flan-t5-xl@")
    assert "the snapshot of google/flan-t5-xl@7d6315df2c2f is not in the Hugging Face cache" in text
    assert text.endswith("hf download google/flan-t5-xl --revision 7d6315df2c2fb742f0f5b556879d730926ca9001 "
                         "--include '*.json' '*.safetensors' '*.model' '*.txt' '*.tiktoken'")


def test_the_cli_says_it_in_one_line_before_loading_anything(cache, tmp_path, capsys):
    from ciar.generate import main

    world = yaml.safe_load(open(cache["world"]["hub"]))
    world["vq_checkpoint"] = "hf://tiny-org/llamagen-t2i@v2/vq_small.pt"  # a tag never fetched
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(world))
    assert main(["--world", str(tmp_path / "w.yaml"), "--prompt", "a bus", "--method", "cloud",
                 "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "vq_checkpoint: hf://tiny-org/llamagen-t2i@v2/vq_small.pt" in err
    assert "vq_small.pt of tiny-org/llamagen-t2i@v2 is not in the Hugging Face cache" in err
    assert not (tmp_path / "x.png").exists()


def _cache_without_t5_weights(cache, home, listing: bool):
    """A copy of the fetched cache at `home` whose T5 snapshot lost its weights (an interrupted download); without
    huggingface_hub's tree listing of the commit when not `listing` (an older huggingface_hub, a hand-made cache)."""
    shutil.copytree(cache["hf_home"], home, symlinks=True)
    repo = home / "hub" / "models--tiny-org--flan-t5-tiny"
    os.remove(repo / "snapshots" / os.listdir(repo / "snapshots")[0] / "model.safetensors")
    if not listing:
        shutil.rmtree(repo / "trees")


def test_an_incomplete_snapshot_is_named_before_a_loader_sees_it(cache, tmp_path, monkeypatch):
    _cache_without_t5_weights(cache, tmp_path / "listed", listing=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "listed"))
    with pytest.raises(WorldSpecError) as e:  # huggingface_hub's tree listing of the commit says what is missing
        read_world(cache["world"]["hub"])
    text = _one_line(e)
    assert "text_encoder: hf://tiny-org/flan-t5-tiny: the cached snapshot of tiny-org/flan-t5-tiny@main is " \
           "incomplete (1 file(s) are missing (model.safetensors))" in text and "fetch" in text
    _cache_without_t5_weights(cache, tmp_path / "unlisted", listing=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "unlisted"))
    with pytest.raises(WorldSpecError) as e:  # no listing: our own check of the folder
        read_world(cache["world"]["hub"])
    assert "text_encoder: hf://tiny-org/flan-t5-tiny: the cached snapshot of tiny-org/flan-t5-tiny@main is " \
           "incomplete (no *.safetensors or pytorch_model*.bin weights)" in _one_line(e)


def test_a_transformers_folder_names_what_it_lacks(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    assert transformers_missing(str(folder)) == "no config.json"
    (folder / "config.json").write_text("{}")
    assert "no *.safetensors" in transformers_missing(str(folder))
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"x")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert transformers_missing(str(folder)) == ("1 of 2 shards named by model.safetensors.index.json missing, e.g. "
                                                 "model-00002-of-00002.safetensors")


def test_the_hubs_own_answers_become_one_line_each(hub, tmp_path):
    """Online, through huggingface_hub against LocalHub: a repository, a revision or a file that does not exist."""
    c = hub["commits"]["t2i"]
    script = ("import json, sys\nfrom ciar.hub import HubError, resolve\nout = []\n"
              "for ref, kind in json.loads(sys.argv[1]):\n"
              "    try:\n        out.append(resolve(ref, kind))\n"
              "    except HubError as e:\n        out.append(str(e))\nprint(json.dumps(out))\n")
    bins = hub["hub"].commit("tiny-org/bin-only", {"config.json": b"{}", "pytorch_model.bin": b"w" * 64,
                                                   "tf_model.h5": b"t" * 64})  # an older repository: .bin weights
    refs = [("hf://tiny-org/nope/x.pt", "file"), (f"hf://tiny-org/llamagen-t2i@{'0' * 40}/t2i_small.pt", "file"),
            (f"hf://tiny-org/llamagen-t2i@{c}/missing.pt", "file"), ("hf://tiny-org/llamagen-t2i", "file"),
            (f"hf://tiny-org/llamagen-t2i@{c}/vq_small.pt", "file"),
            (f"hf://tiny-org/metrics@{hub['commits']['metrics']}", "transformers"),
            (f"hf://tiny-org/bin-only@{bins}", "transformers")]
    r = subprocess.run([sys.executable, "-c", script, json.dumps(refs)], cwd=REPO, capture_output=True, text=True,
                       env=online_env(tmp_path / "hf", hub["hub"].url), timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got[0] == ("hf://tiny-org/nope/x.pt: repository tiny-org/nope not found on the Hub (a typo, or private: "
                      "set HF_TOKEN to a token that can read it)")
    assert got[1] == f"{refs[1][0]}: tiny-org/llamagen-t2i has no revision '{'0' * 40}' (a commit hash, a branch " \
                     "or a tag)"
    assert got[2] == f"{refs[2][0]}: tiny-org/llamagen-t2i@{c[:12]} has no file 'missing.pt'"
    assert got[3].startswith("hf://tiny-org/llamagen-t2i names a whole repository, but a file is needed here")
    assert filecmp.cmp(got[4], hub["local"] / "vq_small.pt", shallow=False)
    assert got[5] == f"{refs[5][0]}: tiny-org/metrics@{hub['commits']['metrics'][:12]} is not a transformers model " \
                     "folder (no config.json)"
    assert sorted(os.listdir(got[6])) == ["config.json", "pytorch_model.bin"]  # the .bin weights, not the .h5
    assert all("\n" not in g for g in got)


def test_without_a_network_the_error_is_one_line_naming_the_reference(hub, tmp_path):
    """Nothing listens on the endpoint (no network): huggingface_hub retries (its backoff, ~25 s), then one line."""
    r = run_fetch(hub["world"]["hub"], tmp_path / "hf", "http://127.0.0.1:9")
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr
    assert last.startswith(f"error: {hub['world']['hub']}: gpt_checkpoint: hf://tiny-org/llamagen-t2i@")
    assert "is not in the Hugging Face cache" in last and "the Hub (http://127.0.0.1:9) could not be reached" in last
    assert last.endswith(f"python -m ciar.world_spec fetch {hub['world']['hub']}")


# ---------------------------------------------------------------------------------------------------- shipped
@pytest.mark.parametrize("name", ["llamagen-xl-stage1.yaml", "llamagen-xl-stage2.yaml",
                                  "llamagen-xl-stage1-eval.yaml", "anole-7b.yaml"])
def test_the_shipped_worlds_name_pinned_hub_files_and_keep_a_mounted_twin(name):
    spec = read_world(os.path.join(REPO, "worlds", name), check=False)
    refs = spec.hub_fields()
    assert refs, name
    for field, value, kind in refs:
        r = parse_ref(value)
        assert r.pinned, f"{name}: {field} is not pinned to a commit"
        assert (kind == "file") == bool(r.path), f"{name}: {field}"
    mounted = read_world(os.path.join(REPO, "worlds", "mounted", name), check=False)
    assert not mounted.hub_fields() and type(mounted) is type(spec)
    same = {k: v for k, v in spec.model_dump().items() if k not in spec.FILES + spec.FOLDERS + ("base_dir",)}
    assert same == {k: v for k, v in mounted.model_dump().items() if k not in spec.FILES + spec.FOLDERS + ("base_dir",)}
    assert {f for f in spec.FILES + spec.FOLDERS if getattr(spec, f)} == \
        {f for f in spec.FILES + spec.FOLDERS if getattr(mounted, f)}


def test_the_shipped_llamagen_worlds_name_lamagens_own_repository():
    s1 = read_world(os.path.join(REPO, "worlds", "llamagen-xl-stage1.yaml"), check=False)
    s2 = read_world(os.path.join(REPO, "worlds", "llamagen-xl-stage2.yaml"), check=False)
    for spec, gpt in ((s1, "t2i_XL_stage1_256.pt"), (s2, "t2i_XL_stage2_512.pt")):
        g, v, t = (parse_ref(x) for x in (spec.gpt_checkpoint, spec.vq_checkpoint, spec.text_encoder))
        assert (g.repo_id, g.path, v.repo_id, v.path) == ("peizesun/llamagen_t2i", gpt, "peizesun/llamagen_t2i",
                                                          "vq_ds16_t2i.pt")
        assert (t.repo_id, t.path, spec.field_kind("text_encoder")) == ("google/flan-t5-xl", "", "transformers")
    a = read_world(os.path.join(REPO, "worlds", "anole-7b.yaml"), check=False)
    assert parse_ref(a.model).repo_id == "leloy/Anole-7b-v0.1-hf" and a.field_kind("model") == "transformers"
    assert (parse_ref(a.vq_checkpoint).repo_id, parse_ref(a.vq_checkpoint).path) == ("GAIR/Anole-7b-v0.1",
                                                                                     "tokenizer/vqgan.ckpt")


# ---------------------------------------------------------------------------------------------------- device models
CALIBRATED = {"gate": "lower", "taus": {"lower": 7.5, "interval": 50.0}, "burst": 4, "burst_entropy": 0.0,
              "span": 2, "target_rate": 0.3,
              "calibration": {"prompts": "coco:val[0:8]", "command": "python -m pipelines.calibrate"}}


@pytest.fixture
def calibrated(hub, tmp_path):
    """A copy of the tiny world's device model with calibrated CIAR defaults in its metadata (as pipelines.calibrate
    writes them; the values are made up, the layout is the real one)."""
    from ciar.models.checkpoint import update_extra

    path = tmp_path / "device.safetensors"
    shutil.copyfile(hub["local"] / "device.safetensors", path)
    update_extra(str(path), {"ciar": CALIBRATED})
    return str(path)


def test_a_device_card_carries_the_files_calibrated_defaults(hub, calibrated, tmp_path, capsys):
    from huggingface_hub import ModelCard

    from pipelines.hub_device import main

    out = tmp_path / "card"
    assert main(["card", calibrated, "--out", str(out), "--repo", "tiny-org/ciar-device-xl",
                 "--world", hub["world"]["hub"]]) == 0
    assert sorted(os.listdir(out)) == ["README.md", "device.safetensors"]
    assert filecmp.cmp(out / "device.safetensors", calibrated, shallow=False)
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "ciar" and card.data.base_model == "tiny-org/llamagen-t2i"
    assert "device-model" in card.data.tags
    assert "gate `lower` (tau 7.5), burst 4, span 2, target cloud-call rate 0.3" in card.text
    assert "device_checkpoint: hf://tiny-org/ciar-device-xl/device.safetensors" in card.text
    assert hashlib.sha256(open(calibrated, "rb").read()).hexdigest() in card.text
    # refused: no calibrated defaults, a device for another cloud model
    capsys.readouterr()
    assert main(["card", str(hub["local"] / "device.safetensors"), "--out", str(tmp_path / "x")]) == 1
    assert "no calibrated CIAR defaults" in capsys.readouterr().err
    assert main(["card", os.path.join(REPO, "weights", "scenes-v2", "device.safetensors"), "--out",
                 str(tmp_path / "y"), "--world", hub["world"]["hub"]]) == 1
    assert "does not fit LlamaGen world GPT-B t2i_small.pt @ 64px" in capsys.readouterr().err


class RecordingHfApi:
    """huggingface_hub's HfApi MOCKED for a unit test without network: records create_repo / upload_folder (and what
    the uploaded folder held) and answers a made-up commit."""

    calls: list = []

    def __init__(self, **kwargs):
        self.calls.append(("init", kwargs))

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        files = {n: open(os.path.join(folder_path, n), "rb").read() for n in sorted(os.listdir(folder_path))}
        self.calls.append(("upload_folder", repo_id, files, kwargs))
        from types import SimpleNamespace

        return SimpleNamespace(oid="c0ffee" + "0" * 34)


def test_push_uploads_the_file_and_its_card_in_one_commit_with_hfapi_mocked(hub, calibrated, monkeypatch, capsys):
    import pipelines.hub_device as hd

    monkeypatch.setattr(hd, "HfApi", RecordingHfApi)
    RecordingHfApi.calls = []
    assert hd.main(["push", calibrated, "--repo", "tiny-org/ciar-device-xl", "--world", hub["world"]["hub"],
                    "--private"]) == 0
    kinds = [c[0] for c in RecordingHfApi.calls]
    assert kinds == ["init", "create_repo", "upload_folder"]
    _, repo, kw = RecordingHfApi.calls[1]
    assert repo == "tiny-org/ciar-device-xl" and kw["exist_ok"] and kw["private"] is True
    _, repo, files, kw = RecordingHfApi.calls[2]
    assert sorted(files) == ["README.md", "device.safetensors"]
    assert files["device.safetensors"] == open(calibrated, "rb").read()
    assert b"library_name: ciar" in files["README.md"] and "gate lower, tau 7.5" in kw["commit_message"]
    assert capsys.readouterr().out.splitlines()[-1] == \
        f"device_checkpoint: hf://tiny-org/ciar-device-xl@c0ffee{'0' * 34}/device.safetensors"


def test_a_pushed_device_is_pulled_into_the_cache_and_named_by_a_world(hub, calibrated, tmp_path, monkeypatch):
    """The card's folder as a repository of LocalHub; `pull` downloads it through huggingface_hub (online), the world
    then loads it from the cache offline, with its calibrated defaults."""
    from pipelines.hub_device import write_card

    write_card(calibrated, str(tmp_path / "card"), read_world(hub["world"]["local"], check=False))
    commit = hub["hub"].commit("tiny-org/ciar-device-xl", {"": str(tmp_path / "card")})
    home, out = tmp_path / "hf", tmp_path / "volume" / "device.safetensors"
    r = subprocess.run([sys.executable, "-m", "pipelines.hub_device", "pull", "hf://tiny-org/ciar-device-xl",
                        "--world", hub["world"]["local"], "--out", str(out)], cwd=REPO, capture_output=True,
                       text=True, env=online_env(home, hub["hub"].url), timeout=300)
    assert r.returncode == 0, r.stderr
    ref = f"hf://tiny-org/ciar-device-xl@{commit}/device.safetensors"
    assert r.stdout.strip() == f"device_checkpoint: {ref}"  # pinned to the commit it came from
    assert "gate lower, tau 7.5, burst 4, span 2" in r.stderr and filecmp.cmp(out, calibrated, shallow=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from ciar.world import load_world

    world = yaml.safe_load(open(hub["world"]["local"]))
    w = load_world({**world, "device_checkpoint": ref, "base_dir": str(hub["root"])}, need_device=True)
    assert w.device_model.ciar_defaults.tau == 7.5 and w.device_file.startswith(str(home / "hub"))
