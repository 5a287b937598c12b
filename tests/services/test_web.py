"""services.web: the browser device as the ingress serves it: its modules at /web/device/ and onnxruntime-web's installed
files at /web/ort/ (issue 28).

    .venv/bin/python -m pytest tests/services/test_web.py

The served-file cases need `make web` (web/node_modules; `make test` runs it) and skip cleanly without it; the
not-installed cases point the package folder at an empty one. The route itself, through Serve, is checked in
tests/services/test_api.py.
"""

import filecmp
import json
import os

import pytest

from services import web

INSTALLED = os.path.isdir(os.path.join(web.ORT_PACKAGE, "dist"))
needs_web = pytest.mark.skipif(not INSTALLED, reason="onnxruntime-web is not installed: run `make web`")


@needs_web
def test_the_pinned_version_is_installed_and_its_wasm_served_byte_for_byte():
    with open(os.path.join(web.ROOT, "web", "package.json"), encoding="utf-8") as f:
        pinned = json.load(f)["dependencies"]["onnxruntime-web"]
    status = web.ort_status()
    assert status["available"] and status["version"] == pinned and status["entry"] in status["files"]
    wasm = [n for n in status["files"] if n.endswith(".wasm")]
    assert wasm, "no WebAssembly build is served"
    for name in wasm:
        path, media_type = web.ort_file(name)
        assert media_type == "application/wasm"
        assert filecmp.cmp(path, os.path.join(web.ORT_PACKAGE, "dist", name), shallow=False)
        with open(path, "rb") as f:
            assert f.read(4) == b"\0asm"


@needs_web
def test_the_entry_point_and_the_wasm_it_imports_are_served_as_javascript():
    path, media_type = web.ort_file(web.ENTRY)
    assert media_type == "text/javascript"
    with open(path, encoding="utf-8") as f:
        entry = f.read()
    loaders = [n for n in web.ort_status()["files"] if n.startswith("ort-wasm") and n.endswith(".mjs")]
    imported = {n for n in loaders if n in entry}
    assert imported, "the entry point imports none of the served WebAssembly loaders"
    for name in imported:
        assert web.ort_file(name)[1] == "text/javascript"
        assert web.ort_file(name.replace(".mjs", ".wasm"))[1] == "application/wasm"


@needs_web
@pytest.mark.parametrize("name", [
    "../package.json", "..", "../../package.json", "/etc/passwd", os.path.join(web.ORT_PACKAGE, "dist", "ort.min.mjs"),
    "..%2Fpackage.json", "%2e%2e%2fpackage.json", "ort.min.mjs.map", "ort.node.min.mjs", "ort.min.mjs/", "",
    "ORT.MIN.MJS", "ort.min.mjs\0.wasm",
])
def test_only_the_listed_files_are_served(name):
    with pytest.raises(LookupError, match="no onnxruntime-web file"):
        web.ort_file(name)


def test_not_installed_says_how_to_enable_the_browser_device(tmp_path, monkeypatch):
    monkeypatch.setattr(web, "ORT_PACKAGE", str(tmp_path))
    status = web.ort_status()
    assert status == {"available": False, "message": web.ENABLE} and "make web" in status["message"]
    for name in ("ort.min.mjs", "ort-wasm-simd-threaded.jsep.wasm", "../package.json"):
        with pytest.raises(LookupError, match="make web"):
            web.ort_file(name)
    (tmp_path / "dist").mkdir()  # an install without the entry point is not a browser device
    (tmp_path / "dist" / "ort-wasm-simd-threaded.wasm").write_bytes(b"\0asm")
    assert not web.ort_status()["available"]


# ---------------------------------------------------------------------------------------------- /web/device/
def test_every_module_of_the_browser_device_is_served_and_its_imports_resolve():
    import re

    names = sorted(n for n in os.listdir(web.DEVICE_SRC) if n.endswith(".js"))
    assert {"worker.js", "loop.js", "maths.js", "wire.js", "connection.js", "runtime.js"} <= set(names)
    for name in names:
        path = web.device_file(name)
        with open(path, encoding="utf-8") as f:
            source = f.read()
        for imported in re.findall(r'from "\./([^"]+)"', source):
            assert web.device_file(imported)  # a relative import the page can load from /web/device/
    with open(web.device_file("worker.js"), encoding="utf-8") as f:
        entry = re.search(r'import\(`\$\{ORT\}([^`]+)`\)', f.read()).group(1)
    assert web.SERVED.fullmatch(entry)  # the runtime it imports is one the ingress serves


@pytest.mark.parametrize("name", ["../package.json", "..", "harness.mjs", "../test/harness.mjs", "/etc/passwd",
                                  "worker.js/", "WORKER.JS", "worker", "", "maths.js.map"])
def test_only_the_browser_devices_modules_are_served(name):
    with pytest.raises(LookupError, match="no browser device file"):
        web.device_file(name)
