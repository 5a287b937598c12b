"""The Serve application on a multi-node Ray cluster (`loadtests.nodeloss.NodeCluster`: a head and four worker nodes,
each a raylet of its own on this machine), placed by custom resources as the KubeRay manifests place it: the verifier
replicas only on the nodes that declare `ciar_verifier`, the simulated phones (Device replicas) only on the nodes
that declare `ciar_device`, the ingress on the head. An image crosses the nodes, and a CIAR image made there equals
the one made in-process. Then the fast version of `loadtests.nodeloss` (issue 40): a verifier node and a device node
lost at once, without warning, under plain and streamed HTTP load, replacement nodes added: no image lost, every one
equal to the undisturbed run's, the pool whole again.
"""

import hashlib

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
requests = pytest.importorskip("requests")

from ciar.testing import write_random_world  # noqa: E402

pytestmark = pytest.mark.cluster  # a Ray cluster of its own (tests/conftest.py)

PORT = 8131
KEY = "multinode-key-0123456789"
PROMPT = "a small red circle at the top on a gray background"
TAU = 0.05
DEVICES_PER_NODE = 2


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    from loadtests.nodeloss import NodeCluster

    weights = write_random_world(str(tmp_path_factory.mktemp("world")), sampling={"cfg_scale": 2.0},
                                 with_device=True)
    args = {"weights_dir": weights, "api_key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
            "devices": 2 * DEVICES_PER_NODE, "device_num_cpus": 0.25, "device_resources": {"ciar_device": 1},
            "verifier_replicas": 2, "verifier_num_cpus": 1.0, "verifier_resources": {"ciar_verifier": 1},
            "verifier_max_sessions": 8, "ingress_num_cpus": 0.1, "ingress_resources": {"ciar_ingress": 1},
            "graceful_shutdown_timeout_s": 0.5, "allow_simulation_params": True}
    # realtime: the simulated links' waits are spent, so an image is in flight for seconds when a node goes
    app = {"args": args, "runtime_env": {}, "import_path": "services.app:build_app",
           "user_configs": {"Device": {"tau": TAU, "span": 4, "prefix_rate": 0.06, "realtime": True},
                            "Verifier": {"idle_timeout_s": 10}}}
    cl = NodeCluster(app, DEVICES_PER_NODE, PORT)
    try:
        cl.start()
        yield {"weights": weights, "cluster": cl, "head": cl.cluster.head_node.node_id,
               "verifier": {n.node_id for n in cl.nodes["verifier"]}, "device": {n.node_id for n in cl.nodes["device"]}}
    finally:
        cl.stop()


def test_replicas_land_on_the_nodes_that_declare_their_resources(nodes):
    from loadtests.nodeloss import placement

    where = placement()
    assert set(where["Verifier"]) == nodes["verifier"] and len(where["Verifier"]) == 2, where
    assert set(where["Device"]) == nodes["device"] and len(where["Device"]) == 2 * DEVICES_PER_NODE, where
    assert where["Ingress"] == [nodes["head"]], where


def test_an_image_crosses_the_nodes_and_equals_the_in_process_one(nodes):
    body = {"prompt": PROMPT, "seed": 4, "method": "ciar", "response_format": "tokens"}
    r = requests.post(f"http://127.0.0.1:{PORT}/v1/images/generations", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["stats"]["verifications"] > 0  # the phone on one node asked a verifier on another

    from ciar.sim.runtime import make_decoder, make_verifier
    from ciar.world import load_default_world

    world = load_default_world(nodes["weights"])
    dec = make_decoder(world, make_verifier(world, max_sessions=1), "ciar", tau=TAU, span=4, prefix_rate=0.06,
                       network="5g")
    assert got["data"][0]["tokens"] == dec.generate(PROMPT, seed=4).tokens.tolist()


def test_losing_a_verifier_node_and_a_device_node_at_once_under_load_loses_no_image(nodes):
    from loadtests.nodeloss import compare, lose_under_load, workload
    from loadtests.jobs import Client, make_jobs

    cl, client = nodes["cluster"], Client(f"http://127.0.0.1:{PORT}", KEY)
    bodies = make_jobs(6, seed=11)
    streams = [{**b, "method": "ciar", "params": {"policy": "fixed"}} for b in make_jobs(2, seed=12)]
    base, wall = workload(client, bodies, streams, 4, None)
    assert compare(base, base)["lost"] == 0, compare(base, base)
    target = {"Verifier": 2, "Device": 2 * DEVICES_PER_NODE, "Ingress": 1}
    # both at once: a phone on the lost device node may hold a session on the lost verifier replica
    r = lose_under_load(cl, "verifier+device", client, bodies, streams, 4, None, 0.3 * wall, 1.0, target, base)
    # (the pool's last samples and where the replicas were after: what a failure here needs to be read)
    report = {**{k: v for k, v in r.items() if k != "pool_samples"}, "last_samples": r["pool_samples"][-6:]}
    assert r["replicas_on_lost_node"].get("Verifier") == 1, report  # the nodes held the replicas
    assert r["replicas_on_lost_node"].get("Device") == DEVICES_PER_NODE, report
    assert r["lost"] == 0 and r["identical"] == r["attempted"] == len(bodies) + len(streams), report
    assert r["pool_whole_after_s"] is not None, report
    assert r["replicas_on_replacement"].get("Verifier") == 1, report
    assert r["replicas_on_replacement"].get("Device") == DEVICES_PER_NODE, report
    # images were in flight on the lost nodes: resumed on a survivor, or run again on a live phone
    assert sum(c["resumes"] + c["device_retries"] for c in r["channels"].values()) > 0, report
