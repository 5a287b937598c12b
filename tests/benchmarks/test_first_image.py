"""benchmarks.first_image on the shipped world, two prompts on 4G: every prompt is the first image of a new device;
an adaptive first image runs at the calibrated point or goes to the cloud whole, so it equals the fixed image or
cloud-only's (same request and seed), and unprimed devices always draft their first image."""

import json

from benchmarks.first_image import main


def test_first_images_are_the_fixed_or_the_cloud_only_image_and_unprimed_devices_draft(tmp_path):
    for prime in (True, False):
        out = tmp_path / f"first_{prime}.json"
        assert main(["--num-prompts", "2", "--links", "4g", "--out", str(out)] + ([] if prime else ["--no-prime"])) == 0
        r = json.loads(out.read_text())
        row = r["rows"]["4g"]
        assert r["primed"] is prime and row["reproduces"] is True and row["cloud-only"]["speedup"] == 1.0
        images = r["images"]["4g"]
        assert all(len(imgs) == 2 for imgs in images.values())
        assert row["to_cloud"] == sum(i["handover"] for i in images["adaptive CIAR"]) / 2
        assert all(i["handover"] == 0 for i in images["fixed CIAR"])
        if not prime:  # nothing known before the image: the calibrated point
            assert row["to_cloud"] == 0 and all(i["adapted"] == 0 for i in images["adaptive CIAR"])
