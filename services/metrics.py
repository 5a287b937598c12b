"""The Ingress's Prometheus metrics (Ray Serve's metrics API; exported with a `ray_` prefix by every node's metrics
agent): what one generation request, one image's stats and one device-endpoint event count.

    metrics = IngressMetrics()
    metrics.request("ciar", 200)
    metrics.image("ciar", stats)           # an image's stats (GenerationOutput.stats)
    metrics.error("device_lost")           # ciar_request_errors_total{kind}
    metrics.device_event("frame", "VERIFY")
"""

from __future__ import annotations


class IngressMetrics:
    def __init__(self):
        from ray.serve import metrics

        self.requests = metrics.Counter("ciar_requests_total", description="generation requests",
                                        tag_keys=("method", "code"))
        self.errors = metrics.Counter("ciar_request_errors_total", description="failed requests", tag_keys=("kind",))
        self.cloud = metrics.Counter("ciar_cloud_calls_total", description="device -> cloud round trips",
                                     tag_keys=("method",))
        self.degraded = metrics.Counter("ciar_degraded_total", description="images finished on the device alone "
                                        "after the cloud became unreachable", tag_keys=("method",))
        self.accept = metrics.Histogram("ciar_accepted_length", description="mean accepted length per image",
                                        boundaries=[1, 1.5, 2, 3, 4, 6, 8, 16], tag_keys=("method",))
        self.latency = metrics.Histogram("ciar_latency_seconds", description="latency split per image",
                                         boundaries=[0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60],
                                         tag_keys=("method", "part"))
        self.handovers = metrics.Counter("ciar_handovers_total", description="images the adaptive policy gave to "
                                         "the cloud whole", tag_keys=("method",))
        self.adapted = metrics.Counter("ciar_adapted_images_total", description="images the adaptive policy made "
                                       "at another span / burst than the calibrated one, or on the cloud whole",
                                       tag_keys=("method",))
        self.overloaded = metrics.Counter("ciar_overloaded_images_total", description="images whose gate ran at a "
                                          "raised tau because the verifier was past overload_verifier_s (graceful "
                                          "degradation)", tag_keys=("method",))
        self.costs = metrics.Histogram("ciar_observed_cost_seconds", description="per image, the costs its device "
                                       "observed: verifier queue wait (summed), and under the adaptive policy its "
                                       "estimates of the link latency, the cloud step and the device step",
                                       boundaries=[0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1],
                                       tag_keys=("method", "cost"))
        self.device_events = metrics.Counter("ciar_device_endpoint_events_total", description="device endpoint: "
                                             "frames by type, errors by status, closes by code, refused keys",
                                             tag_keys=("event", "label"))

    def request(self, method: str, code: int) -> None:
        self.requests.inc(tags={"method": method, "code": str(code)})

    def error(self, kind: str) -> None:
        self.errors.inc(tags={"kind": kind})

    def device_event(self, event: str, label: str) -> None:
        self.device_events.inc(tags={"event": event, "label": label})

    def image(self, m: str, stats: dict) -> None:
        """One image's stats, its method `m`."""
        if stats.get("cloud_requests"):  # Ray counters refuse increments <= 0
            self.cloud.inc(stats["cloud_requests"], tags={"method": m})
        if stats.get("degraded"):
            self.degraded.inc(tags={"method": m})
        if stats.get("handovers"):
            self.handovers.inc(tags={"method": m})
        if stats.get("adapted"):
            self.adapted.inc(tags={"method": m})
        if stats.get("overloaded"):
            self.overloaded.inc(tags={"method": m})
        for cost, key in (("queue", "queue_s"), ("link_latency", "est_link_latency_s"),
                          ("cloud_step", "est_cloud_step_s"), ("device_step", "est_device_step_s")):
            if stats.get(key):  # 0: not observed (fixed policy, or no verify request)
                self.costs.observe(stats[key], tags={"method": m, "cost": cost})
        if stats.get("mean_accepted_length") is not None:
            self.accept.observe(stats["mean_accepted_length"], tags={"method": m})
        for part, key in (("device", "device_s"), ("cloud", "cloud_s"), ("comm", "comm_s"), ("total", "total_s"),
                          ("wall", "wall_s")):
            if stats.get(key) is not None:
                self.latency.observe(stats[key], tags={"method": m, "part": part})
