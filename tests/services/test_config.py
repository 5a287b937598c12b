"""Config, schema and routing logic of the Serve application, without starting Ray (fast unit tests), plus the
shipped YAML files parsed and built into real Serve applications."""

import hashlib
import json
import math
import os

import pytest
import yaml

pytest.importorskip("ray.serve")

from pydantic import ValidationError  # noqa: E402

from ciar.collab.names import METHODS  # noqa: E402
from services.config import AppConfig, DeviceLiveConfig, VerifierLiveConfig  # noqa: E402
from services.schemas import GenerationRequest, MethodParams  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_verifier_routes_by_session_with_rays_consistent_hash_router_and_no_fallback():
    from services.app import build_verifier_app

    d = build_verifier_app({})._bound_deployment
    router = d._deployment_config.request_router_config
    assert router.request_router_class == "services.routing.SessionAffinityRouter"
    assert router.request_router_kwargs == {"num_fallback_replicas": 0}  # strict: a spill would cost a re-prefill


def test_ingress_overflow_is_answered_by_serve_with_retry_after():
    from services.app import build_app

    d = build_app({"allow_unauthenticated": True, "ingress_max_queued_requests": 7, "retry_after_s": 3}
                  )._bound_deployment
    assert d._deployment_config.max_queued_requests == 7
    bp = d._deployment_config.backpressure_config
    assert bp.status_code == 503 and bp.retry_after_s == 3


def test_live_configs_validate_with_field_names():
    assert DeviceLiveConfig(tau=0.2).tau == 0.2
    for bad in ({"tau": -1}, {"span": 0}, {"prefix_rate": 2}, {"tau": float("nan")}, {"unknown": 1}):
        with pytest.raises(ValidationError) as e:
            DeviceLiveConfig(**bad)
        assert list(bad)[0] in str(e.value)
    with pytest.raises(ValidationError, match="max_batch_size"):
        VerifierLiveConfig(max_batch_size=0)


def test_request_schema():
    r = GenerationRequest(prompt="a red circle", params={"tau": 0.1, "cfg_scale": 2})
    assert r.method == "ciar" and r.params.collab().given() == {"tau": 0.1}
    assert r.params.sampling().given() == {"cfg_scale": 2.0}
    with pytest.raises(ValidationError, match="method"):
        GenerationRequest(prompt="x", method="dalle")
    with pytest.raises(ValidationError, match="prompt"):
        GenerationRequest(prompt=" ")
    with pytest.raises(ValidationError, match="unicode"):  # a lone surrogate, as json.loads gives it
        GenerationRequest.model_validate(json.loads('{"prompt": "a red \\ud800 circle"}'))
    assert GenerationRequest(prompt="a 😀 circle", params={"link_drop_after": 3}).params.collab().given() == \
        {"link_drop_after": 3}
    assert MethodParams().collab().given() == {}


def test_model_and_method_are_one_knob():
    """`model` naming a method and `method` are two names of one knob: a body may give one (the schema's `not` says
    so, and the model refuses both, naming them); `model` naming the world leaves `method` to say the method."""
    with pytest.raises(ValidationError, match="give `model` or `method`, not both") as e:
        GenerationRequest.model_validate({"prompt": "x", "model": "ciar", "method": "ciar"})
    assert e.value.errors()[0]["loc"] == ("method",)
    assert GenerationRequest.model_validate({"prompt": "x", "model": "scenes-v2", "method": "cloud"}).method == "cloud"
    assert GenerationRequest.model_validate({"prompt": "x", "model": None, "method": "cloud"}).method == "cloud"
    assert GenerationRequest.model_validate({"prompt": "x", "model": "eagle"}).model == "eagle"
    rule = GenerationRequest.model_json_schema()["not"]
    assert rule["required"] == ["model", "method"] and rule["properties"]["model"]["enum"] == list(METHODS)


def test_the_schemas_take_each_knob_from_the_one_table():
    """MethodParams, CollabOverrides and DeviceLiveConfig state each knob's range as ciar.collab.knobs declares it,
    which is what CollabConfig.validate checks: at and around every bound, all of them agree."""
    from ciar.sim.decoder import CollabConfig
    from ciar.collab.knobs import KNOBS, LIVE_KNOBS, REQUEST_KNOBS
    from services.schemas import CollabOverrides

    assert set(CollabOverrides.model_fields) == set(REQUEST_KNOBS)
    assert set(REQUEST_KNOBS) < set(MethodParams.model_fields) and set(LIVE_KNOBS) < set(DeviceLiveConfig.model_fields)
    for knob in KNOBS.values():
        if knob.kind in (int, float):
            bounds = [b for b in (knob.ge, knob.gt, knob.le) if b is not None]
            values = [knob.kind(b + d) for b in bounds for d in (-1, -0.5, 0, 0.5, 1)
                      if knob.kind is float or float(d).is_integer()] + [math.inf, math.nan]
        else:
            values = list(knob.choices or ()) + ["nope", True, False, 1]
        for v in values:
            core = knob.allows(v)
            try:
                CollabConfig(**{knob.name: v}).validate()
                assert core, (knob.name, v)
            except ValueError as e:
                assert not core and knob.name in str(e), (knob.name, v)
            models = ([MethodParams, CollabOverrides] if knob.request else []) + \
                ([DeviceLiveConfig] if knob.live else [])
            for model in models:
                try:
                    model(**{knob.name: v})
                    ok = True
                except ValidationError as e:
                    ok = False
                    assert knob.name in str(e)
                assert ok == core, (model.__name__, knob.name, v)


def test_api_keys_from_config_and_env(monkeypatch):
    monkeypatch.setenv("CIAR_API_KEYS", "env-key-000001, env-key-000002")
    cfg = AppConfig(api_keys=["file-key-0001"])
    assert cfg.all_api_keys() == ["file-key-0001", "env-key-000001", "env-key-000002"]
    with pytest.raises(ValidationError, match="api keys"):
        AppConfig(api_keys=["short"])
    d = hashlib.sha256(b"hashed-key-0001").hexdigest()
    cfg = AppConfig(api_keys=["file-key-0001"], api_key_sha256=[d.upper()])
    assert cfg.key_digests() == [hashlib.sha256(k.encode()).hexdigest() for k in cfg.all_api_keys()] + [d]
    with pytest.raises(ValidationError, match="64 hex"):
        AppConfig(api_key_sha256=["abc"])


def test_a_config_may_hold_digests_only(monkeypatch):
    """The ingress compares digests: a config with api_key_sha256 alone builds, and its ingress gets that digest
    (tests/services/test_app.py runs the cluster this way, with real HTTP requests)."""
    from services.app import build_app

    monkeypatch.delenv("CIAR_API_KEYS", raising=False)
    d = hashlib.sha256(b"digest-only-key-1").hexdigest()
    app = build_app({"api_key_sha256": [d]})
    assert app._bound_deployment.init_args[1] == [d]


@pytest.fixture(scope="module")
def tiny_llamagen_world(tmp_path_factory):
    """A LlamaGen world of RANDOM-weight files in the real layout (what the GPU config's world is, in small)."""
    from ciar.testing import write_random_llamagen_files

    root = tmp_path_factory.mktemp("llamagen")
    cfg = write_random_llamagen_files(str(root), [1])
    keep = ("gpt_checkpoint", "gpt_config", "gpt_overrides", "image_size", "vq_checkpoint", "vq_overrides",
            "device_checkpoint", "t5_embeddings")
    return {"kind": "llamagen", "base_dir": str(root), **{k: cfg[k] for k in keep}}


@pytest.mark.parametrize("name", ["serve_config.yaml", "serve_config.gpu.yaml"])
def test_shipped_serve_configs_build(name, monkeypatch, tiny_llamagen_world):
    from ray.serve.schema import ServeDeploySchema

    from ciar.world_spec import LlamaGenWorldSpec, read_world
    from services.app import build_app

    with open(os.path.join(REPO, name)) as f:
        raw = yaml.safe_load(f)
    ServeDeploySchema.model_validate(raw) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema(**raw)
    (app,) = raw["applications"]
    assert app["import_path"] == "services.app:build_app"
    monkeypatch.setenv("CIAR_API_KEYS", "k8s-secret-key-01")  # the GPU config takes its keys from the environment
    args = dict(app["args"])
    if "gpu" in name:
        # the LlamaGen-XL world of worlds/mounted/llamagen-xl-stage1.yaml (the Hub world's files on the cluster's
        # models volume), field for field; the build checks them and names the first one missing ...
        with open(os.path.join(REPO, "worlds", "mounted", "llamagen-xl-stage1.yaml")) as f:
            assert args["world"] == yaml.safe_load(f)
        assert isinstance(read_world(args["world"], check=False), LlamaGenWorldSpec)
        with pytest.raises(ValueError, match="world: .*gpt_checkpoint: file not found: /mnt/models/llamagen/"):
            build_app(args)
        args["world"] = tiny_llamagen_world  # ... and the same application builds on a world whose files exist
        with pytest.raises(ValueError, match="text_encoder: encoding new captions needs a local T5 folder"):
            build_app(args)  # a served world must encode new captions: precomputed T5 features are not enough
        args["world"] = {**tiny_llamagen_world, "text_encoder": make_tiny_t5_folder(tiny_llamagen_world)}
    built = build_app(args)  # validates every arg; builds the deployment graph without starting Ray
    assert built is not None
    live = {d["name"]: d["user_config"] for d in app["deployments"]}
    assert set(live) == {"Device", "Verifier"}
    DeviceLiveConfig(**live["Device"])
    VerifierLiveConfig(**live["Verifier"])
    cfg = AppConfig(**app["args"])
    assert cfg.verifier_num_gpus == (1 if "gpu" in name else 0)
    # the fused step where a GPU serves (timed there: 2026-11-28c-gpu); a CPU replica ignores it either way
    assert cfg.verifier_fused_step == ("gpu" in name)
    # overlap where a GPU serves (an H200: 2026-11-29-gpu); the rest did not pay there, or broke (compiled judge)
    assert cfg.verifier_overlap == ("gpu" in name)
    assert cfg.verifier_packed_step is False
    assert cfg.verifier_engine_process is False
    assert cfg.verifier_compiled_judge is False


def make_tiny_t5_folder(world: dict) -> str:
    """A tiny RANDOM T5 encoder of the world's caption width, saved with save_pretrained (ciar.testing)."""
    from ciar.testing import LLAMAGEN_SMALL_GPT, make_tiny_t5

    folder = os.path.join(world["base_dir"], "t5-tiny")
    if not os.path.isdir(folder):
        make_tiny_t5(folder, d_model=LLAMAGEN_SMALL_GPT["caption_dim"])
    return folder


def test_no_keys_is_refused(monkeypatch):
    from services.app import build_app

    monkeypatch.delenv("CIAR_API_KEYS", raising=False)
    with pytest.raises(ValueError, match="no API keys"):
        build_app({})


def test_the_ingress_holds_the_device_connections():
    """Behind Serve a device's WebSocket is one of the ingress's ongoing requests: an ingress that cannot hold the
    endpoint's connections (plus HTTP) would queue them in the proxy and never answer 1013 (device-channel fuzz)."""
    from pydantic import ValidationError

    from services.config import AppConfig

    default = AppConfig(api_keys=["test-key-1"])
    assert default.ingress_max_ongoing_requests > default.device_endpoint.max_connections
    with pytest.raises(ValidationError, match="must exceed device_endpoint.max_connections"):
        AppConfig(api_keys=["test-key-1"], ingress_max_ongoing_requests=64, device_endpoint={"max_connections": 64})


def test_json_safe_drops_non_finite_floats():
    from services.answers import json_safe

    got = json_safe({"a": float("inf"), "b": [1.5, float("nan"), {"c": -float("inf")}], "d": "x", "e": 3})
    assert got == {"a": None, "b": [1.5, None, {"c": None}], "d": "x", "e": 3}
    json.dumps(got, allow_nan=False)


def test_a_device_merges_its_live_defaults_under_the_requests_knobs():
    """Device.config_for: the method's preset, the fleet's live knobs the method takes, the request's over them,
    validated once (the decoder does not check again)."""
    from types import SimpleNamespace

    from services.device import Device
    from services.schemas import CollabOverrides

    phone = SimpleNamespace(live=DeviceLiveConfig(tau=0.3, gate="lower", span=4, burst=2, prefix_rate=0.1))
    cfg = Device.config_for(phone, "ciar", "4g", CollabOverrides(span=8, link_drop_after=5))
    assert (cfg.tau, cfg.gate, cfg.span, cfg.burst, cfg.prefix_rate, cfg.network, cfg.link_drop_after) == \
        (0.3, "lower", 8, 2, 0.1, "4g", 5)
    assert cfg.validated
    eagle = Device.config_for(phone, "eagle", "5g", CollabOverrides())
    assert (eagle.gate, eagle.tau, eagle.burst, eagle.span) == ("always", None, 0, 4)  # the baseline's own knobs
    with pytest.raises(ValueError, match="cloud"):
        Device.config_for(phone, "cloud", "5g", CollabOverrides(prefix_rate=0.5))


def test_verifier_sessions_are_a_count_or_auto():
    assert AppConfig(verifier_max_sessions="auto").verifier_max_sessions == "auto"
    assert AppConfig(verifier_max_sessions=8).verifier_max_sessions == 8
    for bad in (0, "all", -3):
        with pytest.raises(ValidationError, match="verifier_max_sessions"):
            AppConfig(verifier_max_sessions=bad)
    with pytest.raises(ValidationError, match="verifier_memory_utilization"):
        AppConfig(verifier_memory_utilization=1.5)
    with pytest.raises(ValidationError, match="slot_wait_s"):
        VerifierLiveConfig(slot_wait_s=-1)
    with pytest.raises(ValidationError, match="verifier_fused_step"):
        AppConfig(verifier_fused_step="sometimes")
    with pytest.raises(ValidationError, match="verifier_overlap"):
        AppConfig(verifier_overlap="sometimes")
    with pytest.raises(ValidationError, match="verifier_packed_step"):
        AppConfig(verifier_packed_step="sometimes")
    with pytest.raises(ValidationError, match="verifier_engine_process"):
        AppConfig(verifier_engine_process="sometimes")
    with pytest.raises(ValidationError, match="verifier_compiled_judge"):
        AppConfig(verifier_compiled_judge="sometimes")
