"""The Serve application on a multi-node Ray cluster (`ray.cluster_utils.Cluster`: a head and two worker nodes,
each a raylet of its own on this machine), placed by custom resources as the KubeRay manifests place it: the verifier
replicas only on the node that declares `ciar_verifier`, the simulated phones (Device replicas) only on the node that
declares `ciar_device`, the ingress and the controller on the head. An image crosses all three nodes, and a CIAR
image made there equals the one made in-process.
"""

import hashlib

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
requests = pytest.importorskip("requests")

from ciar.testing import write_random_world  # noqa: E402
from services.deploy import deploy_config, patient_serve_env  # noqa: E402

PORT = 8131
KEY = "multinode-key-0123456789"
PROMPT = "a small red circle at the top on a gray background"
TAU = 0.05


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    from ray.cluster_utils import Cluster

    weights = write_random_world(str(tmp_path_factory.mktemp("world")), sampling={"cfg_scale": 2.0},
                                 with_device=True)
    patient_serve_env()
    env = {"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    verifier_node = cluster.add_node(num_cpus=1, resources={"ciar_verifier": 1})
    device_node = cluster.add_node(num_cpus=1, resources={"ciar_device": 4})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, runtime_env=env)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    args = {"weights_dir": weights, "api_key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()], "devices": 2,
            "device_num_cpus": 0.25, "device_resources": {"ciar_device": 1}, "verifier_num_cpus": 0.5,
            "verifier_resources": {"ciar_verifier": 1}, "verifier_max_sessions": 8, "ingress_num_cpus": 0.1,
            "graceful_shutdown_timeout_s": 0.5}
    deploy_config(args, user_configs={"Device": {"tau": TAU, "span": 4, "prefix_rate": 0.06, "realtime": False}})
    yield {"weights": weights, "head": cluster.head_node.node_id, "verifier": verifier_node.node_id,
           "device": device_node.node_id}
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def test_replicas_land_on_the_nodes_that_declare_their_resources(nodes):
    from loadtests.run import each_replica

    device = serve.get_deployment_handle("Device", app_name="ciar")
    phones = each_replica(lambda: device.info.remote().result(timeout_s=60), "device_id", replicas=2)
    verifier = serve.get_deployment_handle("Verifier", app_name="ciar").stats.remote().result(timeout_s=60)
    assert len(phones) == 2 and {p["node_id"] for p in phones.values()} == {nodes["device"]}, phones
    assert verifier["node_id"] == nodes["verifier"], verifier


def test_an_image_crosses_the_nodes_and_equals_the_in_process_one(nodes):
    body = {"prompt": PROMPT, "seed": 4, "method": "ciar", "response_format": "tokens"}
    r = requests.post(f"http://127.0.0.1:{PORT}/v1/images/generations", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["stats"]["verifications"] > 0  # the phone on one node asked the verifier on another

    from ciar.collab.runtime import make_decoder, make_verifier
    from ciar.world import load_default_world

    world = load_default_world(nodes["weights"])
    dec = make_decoder(world, make_verifier(world, max_sessions=1), "ciar", tau=TAU, span=4, prefix_rate=0.06,
                       network="5g")
    assert got["data"][0]["tokens"] == dec.generate(PROMPT, seed=4).tokens.tolist()
