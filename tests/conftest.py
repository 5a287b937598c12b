"""Test-session settings (offline Hugging Face, torch threads, GPU tests skipped without CUDA), the shared Ray instance
and the split of `make test` into two runs (tests/run_suite.py), and the small random-weight models of the
collaborative-decoding tests."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import pytest  # noqa: E402
import torch  # noqa: E402

# two torch threads in a single run; one in each of `make test`'s two runs (tests/run_suite.py sets CIAR_TEST_RUN to
# "ray" or "rest" in them), which share the machine's cores between them
RUN = os.environ.get("CIAR_TEST_RUN")
torch.set_num_threads(int(os.environ.get("CIAR_TEST_THREADS", "1" if RUN else "2")))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEIGHTS = os.path.join(REPO, "weights", "scenes-v1")


@pytest.hookimpl(tryfirst=True)  # before pytest's own (`-m` deselects there), so that `-m ray_serial` sees the marker
def pytest_collection_modifyitems(config, items):
    _SHARED["modules"] = {_module_of(i) for i in items if "shared_ray" in getattr(i, "fixturenames", ())}
    _group_shared_ray_modules(items)
    for item in items:
        if _is_cluster(item):
            item.add_marker(RAY_SERIAL)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# ---------------------------------------------------------------------------------------------------------------
# One local Ray instance for the test modules that need a plain one (Ray Data pipelines, Serve applications on one
# node): starting and stopping Ray costs 5-10 s a module on 2 cores. Those modules run one after another (moved, in
# their order, to where the first of them was) and share it; it is shut down after the last, so a module that starts
# a cluster of its own (several nodes, its own ray.init) never meets it.

SHARED_RAY_METRICS_PORT = 8124  # Ray's Prometheus endpoint of the shared instance (tests/services/test_app.py)
_SHARED = {"last_module": None, "modules": set()}


def _module_of(item) -> str:
    return item.nodeid.split("::")[0]


def _group_shared_ray_modules(items) -> None:
    uses = _SHARED["modules"]
    if not uses:
        return
    first = next(k for k, i in enumerate(items) if _module_of(i) in uses)
    shared = [i for i in items if _module_of(i) in uses]
    rest = [i for i in items if _module_of(i) not in uses]
    items[:] = rest[:first] + shared + rest[first:]


# ---------------------------------------------------------------------------------------------------------------
# `make test` (tests/run_suite.py) runs the suite as two plain pytest runs started together: every test that runs a
# Ray cluster or Serve (the modules that use `shared_ray`, whole, and the tests marked `cluster`) is marked
# `ray_serial` here, at collection, and runs in the `ray` run (`-m "... and ray_serial"`), one after another in the
# order above, so there is one Ray instance on the machine at a time, the shared instance keeps its place, and the
# fixed HTTP ports of the Serve tests are never wanted twice. The `rest` run (`-m "... and not ray_serial"`) takes
# everything else meanwhile (the cluster tests leave the machine about half idle: replicas wait on each other and on
# simulated links).

RAY_SERIAL = "ray_serial"


def _is_cluster(item) -> bool:
    """The item's module uses the shared Ray instance (the whole module, as above), or the item is marked `cluster`."""
    return _module_of(item) in _SHARED["modules"] or item.get_closest_marker("cluster") is not None


@pytest.fixture(autouse=True)
def _ray_only_in_cluster_modules(request):
    """A test outside the cluster modules must not leave Ray running in its process: in `make test`'s `rest` run it
    would run beside the `ray` run's instance (mark its module `pytestmark = pytest.mark.cluster`)."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and not _is_cluster(request.node) and ray.is_initialized():
        pytest.fail(f"{_module_of(request.node)} leaves Ray running: mark the module `pytest.mark.cluster`")


def pytest_collection_finish(session):
    mods = [_module_of(i) for i in session.items if _module_of(i) in _SHARED["modules"]]
    _SHARED["last_module"] = mods[-1] if mods else None
    if RUN in ("ray", "rest"):  # one of run_suite's two runs: the split held (the marker was there before `-m`)
        wrong = [i.nodeid for i in session.items if _is_cluster(i) != (RUN == "ray")]
        if wrong:
            raise pytest.UsageError(f"the {RUN} run of tests/run_suite.py selected {len(wrong)} test(s) of the other "
                                    f"run, e.g. {wrong[0]}: is tests/conftest.py's `ray_serial` marker added before "
                                    f"pytest's -m deselection?")


@pytest.fixture(scope="module")
def shared_ray(request):
    """The shared local Ray instance (4 CPUs, no dashboard, offline Hugging Face and one OpenMP thread in every
    worker, Ray's metrics on SHARED_RAY_METRICS_PORT every second), started by the first module that asks. A module
    that starts Serve shuts Serve down itself; Ray is shut down after the last module that asks."""
    ray = pytest.importorskip("ray")
    from services.deploy import OFFLINE_ONE_THREAD_ENV, patient_serve_env

    if not ray.is_initialized():
        patient_serve_env()  # Serve's controller inherits the driver's environment
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env=OFFLINE_ONE_THREAD_ENV,
                 _metrics_export_port=SHARED_RAY_METRICS_PORT, _system_config={"metrics_report_interval_ms": 1000})
    try:
        yield ray
    finally:
        if _SHARED["last_module"] in (None, _module_of(request.node)):
            ray.shutdown()


@pytest.fixture(scope="session")
def weights_dir():
    return WEIGHTS


# ---------------------------------------------------------------------------------------------------------------
# Small RANDOM-weight cloud + device models for the collaborative-decoding tests (not the trained world): used by
# tests/collab, the wire codec's and the device endpoint's tests.


from ciar.testing import CAPTION_DIM, CAPTION_LEN, StubTextEncoder, tiny_cloud_model  # noqa: E402,F401


@pytest.fixture(scope="module")
def tiny_cloud():
    return tiny_cloud_model()


@pytest.fixture(scope="module")
def tiny_device(tiny_cloud):
    from ciar.collab.device import DeviceConfig, DeviceModel

    torch.manual_seed(1)
    dev = DeviceModel.from_cloud(tiny_cloud, DeviceConfig(n_layer=1))
    with torch.no_grad():  # perturb so the device differs from the cloud and its radii vary by token
        for p in dev.inter_head.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return dev.eval()


@pytest.fixture(scope="module")
def stub_text():
    return StubTextEncoder()


@pytest.fixture(scope="module")
def median_tau(tiny_device, stub_text):
    """The median normalised U of the (random) tiny device on random contexts (CFG 2, temperature 1): a tau at
    which both local accepts and verifications happen."""
    from ciar.collab.gating import gate_scores
    from ciar.collab.interval import guided_interval

    cap = stub_text.encode(["a small red circle at the top on a gray background"])
    toks = torch.randint(0, tiny_device.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = tiny_device(toks.expand(2, -1), cap.emb.expand(2, -1, -1), cap.mask.expand(2, -1),
                          drop=torch.tensor([False, True]))
        c, r = guided_interval(out.center[0], out.radius[0], out.center[1], out.radius[1], cfg_scale=2.0,
                               temperature=1.0)
    return float(gate_scores("interval", center=c, radius=r).median())


@pytest.fixture(scope="session")
def onnx_dir(tmp_path_factory):
    """The shipped device model exported for the torch-free client (pipelines.export_onnx): the weights' own export
    when it was made from the shipped device file (`make test` makes it first), else once per test session;
    $CIAR_TEST_ONNX_DIR names an existing export instead (skips the ~30 s export)."""
    from ciar.sim.runtime import exported_from
    from ciar.world import default_weights_dir
    from pipelines.export_onnx import export_onnx

    out = os.environ.get("CIAR_TEST_ONNX_DIR")
    if out and os.path.isfile(os.path.join(out, "manifest.json")):
        return out
    shipped = os.path.join(default_weights_dir(), "onnx")
    if exported_from(shipped, os.path.join(default_weights_dir(), "device.safetensors")):
        return shipped
    out = str(tmp_path_factory.mktemp("onnx"))
    export_onnx(None, out)
    return out
