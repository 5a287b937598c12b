"""cluster/ manifests: they parse, the RayService embeds the same Serve application as serve_config.gpu.yaml (the
sync check), secrets, GPUs and weights are wired the same way in every pod, the `ray up` cluster is the RayService's
on VMs (ports, node resources, placement, GCS fault tolerance, keys from the environment), the Dockerfile installs
the project like the Makefile, and the application builder accepts the embedded args (graph built, no Ray
started)."""

import glob
import hashlib
import os
import re

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(REPO, "cluster")
SECRET_NAME = "ciar-api-keys"
SECRET_ENV = {"CIAR_API_KEYS": "keys", "CIAR_DEVICE_KEYS": "device-keys", "CIAR_SESSION_SECRET": "session-secret"}
REDIS_PASSWORD_KEY = "redis-password"  # the GCS fault tolerance's Redis (cluster/redis.yaml)
APP_FIELDS = ("name", "route_prefix", "import_path", "args", "deployments", "runtime_env")


def _load_all(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _load(path):
    docs = _load_all(path)
    assert len(docs) == 1, f"{path}: expected one YAML document, got {len(docs)}"
    return docs[0]


@pytest.fixture(scope="module")
def rayservice():
    return _load(os.path.join(CLUSTER, "rayservice.yaml"))


@pytest.fixture(scope="module")
def serve_v2(rayservice):
    raw = rayservice["spec"]["serveConfigV2"]
    assert isinstance(raw, str), "serveConfigV2 must be a YAML string (KubeRay's format)"
    return yaml.safe_load(raw)


@pytest.fixture(scope="module")
def gpu_config():
    return _load(os.path.join(REPO, "serve_config.gpu.yaml"))


@pytest.fixture(scope="module")
def app_args(serve_v2):
    (app,) = serve_v2["applications"]
    return app["args"]


def _pod_specs(rayservice):
    """(group name, pod spec, rayStartParams) of the head group and every worker group."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    out = [("head", head["template"]["spec"], head.get("rayStartParams", {}))]
    for g in cluster["workerGroupSpecs"]:
        out.append((g["groupName"], g["template"]["spec"], g.get("rayStartParams", {})))
    return out


def _requests_gpu(container):
    res = container.get("resources", {})
    return any("nvidia.com/gpu" in (res.get(k) or {}) for k in ("limits", "requests"))


# (a) every manifest parses ------------------------------------------------------------------------------------

def test_every_yaml_in_cluster_parses():
    paths = sorted(glob.glob(os.path.join(CLUSTER, "*.yaml")) + glob.glob(os.path.join(CLUSTER, "*.yml")))
    names = {os.path.basename(p) for p in paths}
    assert {"rayservice.yaml", "secret.example.yaml", "ray-cluster.yaml"} <= names
    for p in paths:
        docs = _load_all(p)
        assert docs, f"{p} is empty"
        for d in docs:
            assert isinstance(d, dict), f"{p}: a document is not a mapping"
            if "apiVersion" in d:  # Kubernetes objects
                assert d.get("kind") and d.get("metadata", {}).get("name"), f"{p}: kind/metadata.name missing"


def test_rayservice_kind(rayservice):
    assert rayservice["apiVersion"] == "ray.io/v1"
    assert rayservice["kind"] == "RayService"


# (b) the sync check: same application as serve_config.gpu.yaml -------------------------------------------------

def test_serve_config_v2_equals_gpu_config(serve_v2, gpu_config):
    (ours,) = serve_v2["applications"]
    (theirs,) = gpu_config["applications"]
    for field in APP_FIELDS:
        assert ours.get(field) == theirs.get(field), \
            f"cluster/rayservice.yaml serveConfigV2 drifted from serve_config.gpu.yaml on `{field}`"
    assert ours["args"]["api_keys"] == [], "keys come from $CIAR_API_KEYS (the Secret), never from the manifest"
    for field in ("proxy_location", "http_options"):
        assert serve_v2.get(field) == gpu_config.get(field), f"top-level `{field}` drifted"


def test_serve_config_v2_validates_with_ray_schema(serve_v2):
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_v2) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(serve_v2)
    (app,) = schema.applications
    assert app.import_path == "services.app:build_app"
    assert {d.name for d in app.deployments} == {"Device", "Verifier"}


def test_user_configs_validate_as_live_configs(serve_v2):
    from services.config import AppConfig, DeviceLiveConfig, VerifierLiveConfig

    (app,) = serve_v2["applications"]
    live = {d["name"]: d["user_config"] for d in app["deployments"]}
    DeviceLiveConfig(**live["Device"])
    VerifierLiveConfig(**live["Verifier"])
    AppConfig(**app["args"])


# (c) secrets ------------------------------------------------------------------------------------------------

def test_every_container_reads_keys_and_session_secret_from_the_secret(rayservice):
    from services.config import API_KEYS_ENV, DEVICE_KEYS_ENV, SESSION_SECRET_ENV

    assert set(SECRET_ENV) == {API_KEYS_ENV, DEVICE_KEYS_ENV, SESSION_SECRET_ENV}, "env names drifted from services/"
    n = 0
    for group, spec, _ in _pod_specs(rayservice):
        for c in spec["containers"]:
            n += 1
            env = {e["name"]: e for e in c.get("env", [])}
            for var, key in SECRET_ENV.items():
                assert var in env, f"{group}/{c['name']}: {var} missing"
                assert "value" not in env[var], f"{group}/{c['name']}: {var} must not be a literal"
                ref = env[var]["valueFrom"]["secretKeyRef"]
                assert ref == {"name": SECRET_NAME, "key": key}, f"{group}/{c['name']}: {var} -> {ref}"
    assert n >= 3


def test_secret_example_matches_references():
    (secret,) = _load_all(os.path.join(CLUSTER, "secret.example.yaml"))
    assert secret["kind"] == "Secret" and secret["apiVersion"] == "v1"
    assert secret["metadata"]["name"] == SECRET_NAME
    data = secret.get("stringData") or secret.get("data")
    assert set(data) == set(SECRET_ENV.values()) | {REDIS_PASSWORD_KEY}
    for key, value in data.items():
        assert "REPLACE" in value.upper(), f"secret.example.yaml `{key}` must be an obvious placeholder"


def test_gcs_fault_tolerance_points_at_the_redis_and_its_password(rayservice):
    """The RayService's GCS keeps its metadata in cluster/redis.yaml's Redis (KubeRay's gcsFaultToleranceOptions):
    the address is that Service's, the password the same Secret key the Redis container requires, and Redis keeps an
    append-only file on a persistent volume (a restarted Redis pod keeps what the GCS stored)."""
    ft = rayservice["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _load_all(os.path.join(CLUSTER, "redis.yaml"))}
    host, port = ft["redisAddress"].split(":")
    svc = docs[("Service", host)]
    assert int(port) in [p["port"] for p in svc["spec"]["ports"]]
    assert ft["redisPassword"]["valueFrom"]["secretKeyRef"] == {"name": SECRET_NAME, "key": REDIS_PASSWORD_KEY}
    dep = next(d for (kind, _), d in docs.items() if kind == "Deployment")
    assert dep["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    (redis,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in redis["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": SECRET_NAME, "key": REDIS_PASSWORD_KEY}
    command = " ".join(redis["command"])
    assert '--requirepass "$REDIS_PASSWORD"' in command and "--appendonly yes" in command and "--dir /data" in command
    (mount,) = redis["volumeMounts"]
    (vol,) = dep["spec"]["template"]["spec"]["volumes"]
    assert mount["mountPath"] == "/data" and vol["name"] == mount["name"]
    assert ("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"]) in docs
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"


def test_no_dev_key_in_the_rayservice(rayservice):
    text = yaml.safe_dump(rayservice)
    assert "ciar-dev-key" not in text


# (d) groups, GPUs, weights -------------------------------------------------------------------------------------

def test_exactly_one_gpu_worker_group_and_verifier_on_one_gpu(rayservice, app_args):
    pods = _pod_specs(rayservice)
    head_spec = pods[0][1]
    assert not any(_requests_gpu(c) for c in head_spec["containers"]), "the head has no GPU"
    gpu_groups = [(g, spec, params) for g, spec, params in pods[1:]
                  if any(_requests_gpu(c) for c in spec["containers"])]
    assert len(gpu_groups) == 1, [g for g, _, _ in gpu_groups]
    group, spec, params = gpu_groups[0]
    for c in spec["containers"]:
        for k in ("limits", "requests"):
            assert int(c["resources"][k]["nvidia.com/gpu"]) == 1, f"{group}: one GPU per pod"
    assert str(params.get("num-gpus")) == "1"
    assert app_args["verifier_num_gpus"] == 1
    # the GPU pods offer Ray exactly the Verifier's CPUs, so Device actors are placed on the CPU group
    assert float(params["num-cpus"]) == float(app_args["verifier_num_cpus"])
    cpu_groups = [(g, params) for g, spec, params in pods[1:] if (g, spec, params) not in gpu_groups]
    assert len(cpu_groups) >= 1, "a CPU worker group for the Device actors"
    for g, params in cpu_groups:
        assert "num-gpus" not in params
    # the fleet fits in the CPU groups at their minimum size
    cluster = rayservice["spec"]["rayClusterConfig"]
    cpus = sum(float(g["rayStartParams"]["num-cpus"]) * g["minReplicas"] for g in cluster["workerGroupSpecs"]
               if g["groupName"] in {n for n, _ in cpu_groups})
    assert cpus >= app_args["devices"] * app_args["device_num_cpus"]
    max_gpu_pods = next(g["maxReplicas"] for g in cluster["workerGroupSpecs"] if g["groupName"] == group)
    assert max_gpu_pods >= app_args["verifier_autoscaling"]["max_replicas"]


def _declared(params: dict) -> dict:
    """A KubeRay rayStartParams `resources` value ('"{\\"name\\": n}"', JSON quoted as a string) -> {name: n}."""
    import json

    raw = params.get("resources")
    return json.loads(json.loads(raw)) if raw else {}


def test_custom_resources_place_verifiers_and_phones_on_their_pods(rayservice, app_args):
    """As tests/services/test_multinode.py runs it: verifiers only where `verifier_resources` is declared (the GPU
    group, one replica per pod), phones only where `device_resources` is (the CPU groups, the whole fleet fits)."""
    (vname, vamount), = app_args["verifier_resources"].items()
    (dname, damount), = app_args["device_resources"].items()
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert not _declared(cluster["headGroupSpec"]["rayStartParams"]), "nothing is placed on the head by resource"
    for g in cluster["workerGroupSpecs"]:
        declared = _declared(g["rayStartParams"])
        gpu = "num-gpus" in g["rayStartParams"]
        assert (vname in declared) == gpu and (dname in declared) == (not gpu), g["groupName"]
        if gpu:
            assert declared[vname] == vamount, "one Verifier replica per GPU pod"
        else:
            assert declared[dname] * g["minReplicas"] >= app_args["devices"] * damount, "the fleet fits"
    types = _load(os.path.join(CLUSTER, "ray-cluster.yaml"))["available_node_types"]
    for name, t in types.items():
        res = t.get("resources", {})
        assert (vname in res) == bool(res.get("GPU")), name
        assert (dname in res) == (not res.get("GPU") and name != "head"), name


def _world_paths(app_args) -> list[str]:
    from ciar.world_spec import read_world, spec_dict

    d = spec_dict(read_world(app_args["world"], check=False))
    return [v for v in d.values() if isinstance(v, str) and v.startswith("/")]


def test_models_volume_mounted_read_only_under_every_world_file(rayservice, app_args):
    paths = _world_paths(app_args)
    assert len(paths) >= 4  # GPT, VQ, T5 folder, device model
    for group, spec, _ in _pod_specs(rayservice):
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            mounts = [m for m in c.get("volumeMounts", [])
                      if all(p.startswith(m["mountPath"].rstrip("/") + "/") for p in paths)]
            assert len(mounts) == 1, f"{group}: the world's files {paths} are not under one mount"
            assert mounts[0].get("readOnly") is True
            pvc = vols[mounts[0]["name"]]["persistentVolumeClaim"]
            assert pvc["claimName"] == "ciar-weights" and pvc.get("readOnly") is True


def test_ray_versions_agree(rayservice):
    with open(os.path.join(CLUSTER, "Dockerfile")) as f:
        m = re.search(r"^ARG RAY_VERSION=(\S+)$", f.read(), re.M)
    assert m, "Dockerfile pins Ray with ARG RAY_VERSION"
    assert rayservice["spec"]["rayClusterConfig"]["rayVersion"] == m.group(1)
    with open(os.path.join(CLUSTER, "ray-cluster.yaml")) as f:
        assert f"ray[serve,data]=={m.group(1)}" in f.read()


# ray up config ---------------------------------------------------------------------------------------------

def test_ray_up_config_validates(app_args):
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = _load(os.path.join(CLUSTER, "ray-cluster.yaml"))
    cfg = prepare_config(raw)
    validate_config(cfg)
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert head.get("resources", {}).get("GPU", 0) == 0
    gpu = [t for t in types.values() if t.get("resources", {}).get("GPU")]
    assert len(gpu) == 1 and gpu[0]["resources"]["GPU"] == 1
    assert gpu[0]["resources"]["CPU"] == app_args["verifier_num_cpus"]
    cpu_only = [n for n, t in types.items() if n != cfg["head_node_type"] and not t.get("resources", {}).get("GPU")]
    assert cpu_only, "a CPU worker type for the Device actors"
    setup = "\n".join(raw["setup_commands"])
    assert '"torch==2.13.0"' in setup and "[serve]" in setup
    assert setup.index("torch==2.13.0") < setup.index("[serve]"), "torch is installed first"
    mount = os.path.commonpath(_world_paths(app_args)).split("/")[:3]  # /mnt/models
    assert "/".join(mount) in setup
    for cmds in (raw["head_start_ray_commands"], raw["worker_start_ray_commands"]):
        assert any("ciar.env" in c and "ray start" in c for c in cmds), "secrets exported into ray start"
    with open(os.path.join(CLUSTER, "ray-cluster.yaml")) as f:
        text = f.read()
    assert "ray up cluster/ray-cluster.yaml" in text and "serve deploy serve_config.gpu.yaml" in text


# the `ray up` cluster is the RayService's on VMs ----------------------------------------------------------------
# What must agree between cluster/rayservice.yaml and cluster/ray-cluster.yaml: the ports, what each kind of node
# offers Ray (CPUs, GPUs, custom resources, group sizes), hence where each deployment of serve_config.gpu.yaml can
# land (nothing on the head), the GCS's fault tolerance, and keys that come from secrets / the environment.

ROLES = {"ciar_verifier": "verifier", "ciar_device": "devices"}  # a worker kind by the custom resource it declares
RAY_UP_ENV_DIR = "~/.ciar/"  # where `ray up` copies the keys from: the user's machine, never the repository


def _role(resources: dict) -> str:
    (role,) = {ROLES[r] for r in resources if r in ROLES} or {"?"}
    return role


def _rayservice_nodes(rayservice) -> dict[str, dict]:
    """role -> what one node offers Ray ({CPU, GPU, custom...}) and the group's min / max size."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["rayStartParams"]
    out = {"head": {"offers": {"CPU": float(head["num-cpus"]), "GPU": float(head.get("num-gpus", 0)),
                               **_declared(head)}, "min": 1, "max": 1}}
    for g in cluster["workerGroupSpecs"]:
        params, declared = g["rayStartParams"], _declared(g["rayStartParams"])
        out[_role(declared)] = {"offers": {"CPU": float(params["num-cpus"]), "GPU": float(params.get("num-gpus", 0)),
                                           **declared}, "min": g["minReplicas"], "max": g["maxReplicas"]}
    return out


def _ray_up_nodes(raw) -> dict[str, dict]:
    out = {}
    for name, t in raw["available_node_types"].items():
        res = {k: float(v) for k, v in t["resources"].items()}
        offers = {"CPU": res.pop("CPU"), "GPU": res.pop("GPU", 0.0), **res}
        if name == raw["head_node_type"]:
            out["head"] = {"offers": offers, "min": 1, "max": 1}
        else:
            out[_role(res)] = {"offers": offers, "min": t["min_workers"], "max": t["max_workers"]}
    return out


@pytest.fixture(scope="module")
def ray_up():
    return _load(os.path.join(CLUSTER, "ray-cluster.yaml"))


def _start(raw, kind: str) -> str:
    """The `ray start` command of the head (kind head) or of the workers, as the shell gets it."""
    (cmd,) = [c for c in raw[f"{kind}_start_ray_commands"] if "ray start" in c]
    return cmd


def test_both_clusters_offer_the_same_nodes(rayservice, ray_up):
    ours, theirs = _rayservice_nodes(rayservice), _ray_up_nodes(ray_up)
    assert set(ours) == set(theirs) == {"head", "verifier", "devices"}, (ours, theirs)
    assert ours == theirs
    # what a `ray up` head offers is its start command's too (the autoscaler's resources override aside)
    assert "--num-cpus=0" in _start(ray_up, "head")


def test_every_deployment_lands_on_the_same_kind_of_node_and_none_on_the_head(rayservice, ray_up, gpu_config):
    """Where each deployment's replicas fit, from serve_config.gpu.yaml's args: the verifiers on the GPU nodes (one
    each), the phones on the device nodes, the Ingress replicas in what the phones leave of the device nodes: in both
    clusters, and never on the head (a lost head takes no replica; GCS fault tolerance)."""
    from services.config import AppConfig

    (app,) = gpu_config["applications"]
    cfg = AppConfig(**app["args"])
    demand = {"Verifier": {"CPU": cfg.verifier_num_cpus, "GPU": cfg.verifier_num_gpus, **cfg.verifier_resources},
              "Device": {"CPU": cfg.device_num_cpus, **cfg.device_resources},
              "Ingress": {"CPU": cfg.ingress_num_cpus, **cfg.ingress_resources}}

    def fits(need: dict, free: dict) -> int:
        return min(int(free.get(k, 0) / v + 1e-9) for k, v in need.items() if v > 0)

    for nodes in (_rayservice_nodes(rayservice), _ray_up_nodes(ray_up)):
        left = {}  # role -> what a node offers after the replicas it is meant for
        for role, node in nodes.items():
            free = dict(node["offers"])
            for dep in ("Verifier", "Device"):
                n = fits(demand[dep], free)
                free = {k: v - n * demand[dep].get(k, 0) for k, v in free.items()}
            left[role] = free
        where = {dep: {role for role, node in nodes.items() if fits(need, node["offers"])}
                 for dep, need in demand.items() if dep != "Ingress"}
        assert where == {"Verifier": {"verifier"}, "Device": {"devices"}}, where
        assert fits(demand["Verifier"], nodes["verifier"]["offers"]) == 1, "one Verifier replica per GPU node"
        assert fits(demand["Device"], nodes["devices"]["offers"]) * nodes["devices"]["min"] >= cfg.devices
        ingress = {role for role, free in left.items() if fits(demand["Ingress"], free)}
        assert ingress == {"devices"}, ingress
        assert fits(demand["Ingress"], left["devices"]) * nodes["devices"]["min"] >= cfg.ingress_replicas >= 2


def test_both_clusters_use_the_same_ports(rayservice, serve_v2, gpu_config, ray_up):
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    serve_port = gpu_config["http_options"]["port"]
    assert serve_v2["http_options"]["port"] == ports["serve"] == serve_port == 8000
    assert ports["gcs-server"] == 6379 and ports["dashboard"] == 8265
    assert f"--port={ports['gcs-server']}" in _start(ray_up, "head")
    assert f"--dashboard-port={ports['dashboard']}" in _start(ray_up, "head")
    assert f"--address=$RAY_HEAD_IP:{ports['gcs-server']}" in _start(ray_up, "worker")
    with open(os.path.join(CLUSTER, "ray-cluster.yaml")) as f:
        text = f.read()
    assert f"http://localhost:{ports['dashboard']}" in text and f"ray attach cluster/ray-cluster.yaml -p {serve_port}" \
        in text, "the header's commands use the cluster's ports"


def _env_file(raw, mount: str) -> str:
    """The file a file mount copies from: on the user's machine, outside the repository."""
    src = raw["file_mounts"][mount]
    assert src.startswith(RAY_UP_ENV_DIR), f"{mount} must come from {RAY_UP_ENV_DIR}, not the repository: {src}"
    return src


def test_both_clusters_keep_the_gcs_in_redis(rayservice, ray_up):
    """GCS fault tolerance in both: the RayService's gcsFaultToleranceOptions; the head's `ray start` with
    RAY_REDIS_ADDRESS, --redis-password and a storage namespace, all from a file outside the repository that only the
    head keeps; the workers wait as long for a lost GCS as the RayService's worker pods."""
    ft = rayservice["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert ft["redisAddress"] and "valueFrom" in ft["redisPassword"]
    head = _start(ray_up, "head")
    _env_file(ray_up, "~/ciar-gcs.env")
    assert ". ~/ciar-gcs.env" in head
    for setting in ("RAY_REDIS_ADDRESS=", "--redis-password=", "RAY_external_storage_namespace="):
        value = re.search(re.escape(setting) + r'"?(\S+?)"?(\s|$)', head)
        assert value and value.group(1).startswith("$"), f"{setting} must come from the environment: {head}"
    assert "RAY_REDIS_ADDRESS" not in _start(ray_up, "worker") and "redis-password" not in _start(ray_up, "worker")
    assert any("rm -f ~/ciar-gcs.env" in c for c in ray_up["worker_setup_commands"]), "the password stays on the head"
    waits = set()
    for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        for c in g["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            waits.add(env.get("RAY_gcs_rpc_server_reconnect_timeout_s"))
    (wait,) = waits
    assert wait is not None and int(wait) >= 300, "the workers outlast a head's restart"
    assert f"RAY_gcs_rpc_server_reconnect_timeout_s={wait}" in _start(ray_up, "worker")


def test_ray_up_keys_come_from_the_environment(ray_up):
    """Every `ray start` exports ~/.ciar/ciar.env (the keys the RayService's pods get from the Secret, by the same
    names), which the header's first command writes; no key is a literal of the config."""
    _env_file(ray_up, "~/ciar.env")
    for kind in ("head", "worker"):
        assert "set -a && . ~/ciar.env && set +a" in _start(ray_up, kind), kind
    with open(os.path.join(CLUSTER, "ray-cluster.yaml")) as f:
        text = f.read()
    header = text[:text.index("cluster_name:")]
    for var in SECRET_ENV:
        assert f"{var}=%s" in header, f"the header's ciar.env does not set {var}"
        body = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
        assert not re.search(rf"\b{var}=", body), f"{var} set literally in the config"
    assert "ciar-dev-key" not in text and "ciar-dev-device-key" not in text


# (e) Dockerfile --------------------------------------------------------------------------------------------

def test_dockerfile_installs_like_the_makefile():
    with open(os.path.join(CLUSTER, "Dockerfile")) as f:
        text = f.read()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    assert "ARG TORCH_SPEC=torch==2.13.0" in lines
    with open(os.path.join(REPO, "Makefile")) as f:
        assert re.search(r"^TORCH_SPEC \?= torch==2\.13\.0$", f.read(), re.M), "Makefile default changed"
    body = "\n".join(lines)
    torch_at = body.index('pip install "${TORCH_SPEC}"')
    project_at = body.index('pip install -e ".[serve,export]"')
    assert torch_at < project_at, "torch is installed before the project"
    # the device model's export (real devices, and serve_config.yaml's onnx phones) is made from the copied weights
    assert body.index("COPY weights ./weights") < body.index("RUN python -m pipelines.export_onnx")
    for folder in ("ciar", "services", "pipelines", "benchmarks", "loadtests", "weights", "worlds"):
        assert re.search(rf"^COPY {folder} \./{folder}$", body, re.M), f"{folder}/ not copied"
    assert "serve_config.yaml" in body and "serve_config.gpu.yaml" in body
    user = [ln for ln in lines if ln.startswith("USER ")]
    assert user and user[-1] not in ("USER root", "USER 0")
    assert "EXPOSE 8000 8265 6379" in lines
    cmd = [ln for ln in lines if ln.startswith("CMD ")]
    assert cmd[-1] == 'CMD ["serve", "run", "serve_config.yaml"]'


def test_serve_extra_exists():
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        text = f.read()
    assert re.search(r"^serve = \[", text, re.M), "pyproject.toml has no `serve` extra"


# (f) the builder accepts the RayService args -----------------------------------------------------------------

def _deployments(app, out=None):
    """name -> Deployment of a built (unstarted) Serve application graph."""
    out = {} if out is None else out
    dep = app._bound_deployment
    out[dep.name] = dep
    for a in list(dep.init_args) + list(dep.init_kwargs.values()):
        if hasattr(a, "_bound_deployment"):
            _deployments(a, out)
    return out


def test_build_app_accepts_rayservice_args(app_args, monkeypatch, tmp_path):
    from ciar.testing import LLAMAGEN_SMALL_GPT, make_tiny_t5, write_random_llamagen_files
    from ciar.world_spec import read_world, spec_dict
    from services.app import build_app

    monkeypatch.setenv("CIAR_API_KEYS", "test-key-0123456789,test-key-abcdefghij")
    monkeypatch.setenv("CIAR_SESSION_SECRET", "test-session-secret")
    # the world's files live on the cluster's volume: the same fields over tiny RANDOM files in the real layout
    cfg = write_random_llamagen_files(str(tmp_path), [1])
    world = {**app_args["world"], "base_dir": str(tmp_path), "text_dtype": "float32",
             "text_encoder": make_tiny_t5(str(tmp_path / "t5"), d_model=LLAMAGEN_SMALL_GPT["caption_dim"]),
             **{k: cfg[k] for k in ("gpt_checkpoint", "gpt_config", "gpt_overrides", "image_size", "vq_checkpoint",
                                    "vq_overrides", "device_checkpoint")}}
    app = build_app({**app_args, "world": world})
    deps = _deployments(app)
    assert set(deps) == {"Ingress", "Device", "Verifier"}
    ingress, device, verifier = deps["Ingress"], deps["Device"], deps["Verifier"]
    assert ingress.init_args[1] == [hashlib.sha256(k.encode()).hexdigest()
                                    for k in ("test-key-0123456789", "test-key-abcdefghij")]
    assert device.num_replicas == app_args["devices"]
    assert device.ray_actor_options["num_cpus"] == app_args["device_num_cpus"]
    assert verifier.ray_actor_options["num_gpus"] == 1
    assert verifier.init_args[0] == spec_dict(read_world(world)) == device.init_args[0]  # absolute, validated
    assert "test-session-secret" in verifier.init_args


def test_build_app_refuses_rayservice_args_without_keys(app_args, monkeypatch):
    from services.app import build_app

    monkeypatch.delenv("CIAR_API_KEYS", raising=False)
    with pytest.raises(ValueError, match="CIAR_API_KEYS"):
        build_app(dict(app_args))
