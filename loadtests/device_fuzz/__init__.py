"""Fuzz the device channel (ws://HOST/v1/device/sessions, services.device_endpoint) against a live endpoint, while
witness devices make real images; part of `loadtests.fuzz`, which starts the cluster and scans its logs.

    python -m loadtests.fuzz --examples 0 --device-frames 3000 --out runs/device-fuzz     # starts a cluster
    python -m loadtests.fuzz --host http://127.0.0.1:8000 --examples 0 --device-frames 1000 \
        --device-key ciar-dev-device-key --device-key OTHER_KEY

What is sent (`DeviceFuzzer.run`), every wait bounded by `Target.timeout_s` (an answer later than that is a hang):
  frames     hypothesis strategies (`frame_strategies`), by kind: random bodies behind a valid header, bad magic,
             unknown types, another version, truncated and mutated valid frames, well-formed frames with random
             field values and tokens, server-only types, first frames before HELLO, and well-formed VERIFY / RESUME /
             CLOSE frames with random contents on a real session with its valid token (each followed by an empty
             VERIFY: a frame must never leave its session wedged);
  limits     a frame over the frame limit (1009), one exactly at it (answered), empty and text frames (4000);
  order      OPEN before HELLO (4000), HELLO twice (400), VERIFY / RESUME / CLOSE of a session never opened (403),
             OPEN twice for one id (answered as the first: the same token and prefix), another OPEN under an open
             id (409; the session intact and still counted), VERIFY after CLOSE (410);
  tokens     a random token, a token of another session, a token of a closed session (403; 410 on its own session),
             another device's session with its real token (403 with the same message as a session that does not
             exist: nothing is learnt about it);
  sessions   a device opening hundreds of sessions, also opening each id twice and after VERIFYs of sessions it does
             not hold: exactly the per-device limit succeed, the rest are 429 naming session_id, and all of them can
             be opened again once closed (nothing leaked); the verifier holds as many sessions after the run as before;
  readers    a slow reader (sends, never reads; tiny receive buffer; asks for the largest replies, its sessions'
             captions): dropped by the server's send timeout while another connection is answered meanwhile (the
             serving processes' memory is recorded when `Target.server_memory` can read it);
  connections  up to the endpoint's connection limit and beyond (1013, "retry after N s"), the health route and a
             new device answered meanwhile; a handshake held for seconds instead of refused is a failure (a queue in
             front of the endpoint); inconclusive, not failed, when connections that sent no HELLO were closed
             before the last ones were open (the limit was not reached); the per-device connection limit (1008);
             connections that vanish right after HELLO do not use up their device's connections.
Witnesses (`Witnesses`: `ciar_device.loop.generate` over a `DeviceConnection` on the second device key; the tests
pass a torch decoder) make their images once before the fuzz and then in a loop during it: every image must be
bit-identical to the quiet one, without a reconnect. After the fuzz the health route must answer and one more
witness image must be identical. Passes: no ERROR 5xx other than 503, no close 1011, no answer out of time or to
another request id, every answer the expected one.

`run()` -> the summary written to OUT/device_fuzz.json: frames (by kind), answers (by "close:CODE", "error:STATUS",
"reply:TYPE", "timeout"), probes (per probe's figures), phases_s, failures (the first 50, `failure_count` all; a
hang's or a server error's frame whole in `frame_b64`, to replay it), witnesses, healthy, ok. `secrets()`: the
device keys and the session tokens seen (hex), for the log scan.

The modules, by concern:
  channel     `Target`, one raw connection (`Probe`) and its `Answer`, the oracle `expected_answers`, `http_status`
  recorder    `Recorder`: connects, asks, checks every answer and records it (counts, failures, probes, tokens)
  strategies  the hypothesis frames by kind (`frame_strategies`, `FRAME_KINDS`)
  frames      the frame fuzz (`fuzz_frames`)
  protocol    the probes frame_limits, order, tokens, sessions
  connections the probes slow_reader, connections, device_connections
  witnesses   `Witnesses`, `onnx_witnesses`, `WitnessLoop` and the quiet images
  fuzzer      `DeviceFuzzer` (a `Recorder`): the whole run and its report; `summary_lines`
"""

from loadtests.device_fuzz.channel import (ANY_REQUEST_ANSWER, CLIENT_TYPES, PROMPT, Answer, Probe, Target,
                                           expected_answers, http_status)
from loadtests.device_fuzz.connections import QUEUED_HANDSHAKE_S
from loadtests.device_fuzz.frames import HANGS_PER_KIND, fuzz_frames
from loadtests.device_fuzz.fuzzer import DeviceFuzzer, summary_lines
from loadtests.device_fuzz.recorder import FULL_FRAME_BYTES, MAX_FAILURES_KEPT, Recorder
from loadtests.device_fuzz.strategies import FRAME_KINDS, encode_ok, frame_strategies
from loadtests.device_fuzz.witnesses import WITNESS_CASES, WITNESS_ERRORS, WitnessLoop, Witnesses, onnx_witnesses

__all__ = ["ANY_REQUEST_ANSWER", "CLIENT_TYPES", "FRAME_KINDS", "FULL_FRAME_BYTES", "HANGS_PER_KIND",
           "MAX_FAILURES_KEPT", "PROMPT", "QUEUED_HANDSHAKE_S", "WITNESS_CASES", "WITNESS_ERRORS", "Answer",
           "DeviceFuzzer", "Probe", "Recorder", "Target", "WitnessLoop", "Witnesses", "encode_ok", "expected_answers",
           "frame_strategies", "fuzz_frames", "http_status", "onnx_witnesses", "summary_lines"]
