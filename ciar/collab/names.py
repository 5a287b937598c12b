"""The names every layer shares, defined once and importable without torch (the CLI checks its arguments before it
imports torch; the HTTP schemas and the load tests list the same names).

    from ciar.collab.names import METHODS, NETWORKS

METHODS   decoding methods (`ciar.sim.decoder.method_config` presets; the CLI's --method, the API's `method`)
CLOUD_METHODS  the methods that make every token on the cloud (no device model: cloud-only decoding, SJD, GSD)
NETWORKS  simulated device links (`ciar.sim.network.PROFILES`; the CLI's --network, the API's `network`)
GATES     gates that score a draft (`ciar.collab.gating.gate_scores`; the `gate` knob, `ciar.collab.knobs`)
"""

METHODS = ("cloud", "sjd", "gsd", "ciar", "eagle", "lantern", "cascade", "code", "entropy", "softmax", "random", "topk")
CLOUD_METHODS = ("cloud", "sjd", "gsd")
NETWORKS = ("5g", "4g", "wifi", "none")
GATES = ("interval", "lower", "entropy", "softmax", "random", "topk")
