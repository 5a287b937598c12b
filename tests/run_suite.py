"""`make test`'s runner: the suite as two plain pytest runs started together, on a 2-core machine.

- the `ray` run: the tests that start Ray or Serve (tests/conftest.py marks them `ray_serial` at collection: the
  modules that use the shared Ray instance, and the tests marked `cluster`), one after another in one process, so
  there is one Ray instance on the machine at a time and the Serve tests' fixed ports are never wanted twice;
- the `rest` run: everything else, meanwhile (the Ray tests leave the machine about half idle: replicas wait on each
  other and on simulated links).

Both outputs are streamed line by line, prefixed `[ray]` / `[rest]`; at the end each run's exit status, pytest's
summary line and wall time. The runner fails when either run fails. A run that collects nothing (pytest's exit 5)
passes when the other ran tests (the selection holds no test of that kind, e.g. `PYTEST_ARGS=tests/test_lock.py`)
and fails when both collect nothing. Each run uses one torch thread (CIAR_TEST_RUN, read by tests/conftest.py).
Ctrl-C (or SIGTERM) is passed on to the two runs' process groups, which the runner started; nothing else is stopped.

    python tests/run_suite.py [--workers 2|1|0] [-m EXPR] [-- PYTEST_ARGS...]

`-m` is the marker expression both runs share (`make test`: "not slow and not gpu"); a `-m` among PYTEST_ARGS
replaces it, as a later `-m` does on pytest's command line. `--workers 0` (or 1) runs the selection in one plain
pytest process instead (two torch threads; exit 5 fails there as in pytest). Standard library only.
"""

import argparse
import collections
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

MARKER = "ray_serial"  # registered in pyproject.toml, added by tests/conftest.py
RUN_ENV = "CIAR_TEST_RUN"  # "ray" or "rest" in the two runs' environments
NO_TESTS = 5  # pytest's ExitCode.NO_TESTS_COLLECTED
POLL_S = 0.1  # how often the runner looks whether a run has ended (its wall time)
STOP_GRACE_S = 30.0  # after a forwarded Ctrl-C: how long the runs may take to shut down (Ray included) before a kill


def take_markexpr(args: list) -> tuple:
    """(the last `-m EXPR` / `-mEXPR` / `--markexpr EXPR` / `--markexpr=EXPR` of the pytest arguments, or None; the
    arguments without them)."""
    expr, rest, i = None, [], 0
    while i < len(args):
        a = args[i]
        if a in ("-m", "--markexpr") and i + 1 < len(args):
            expr, i = args[i + 1], i + 2
            continue
        if a.startswith("--markexpr="):
            expr = a.split("=", 1)[1]
        elif a.startswith("-m") and not a.startswith("--") and len(a) > 2:
            expr = a[2:]
        else:
            rest.append(a)
        i += 1
    return expr, rest


def run_expr(expr: str, run: str) -> str:
    """The marker expression of the `ray` or `rest` run: `expr` (may be empty) and the split on MARKER."""
    split = MARKER if run == "ray" else f"not {MARKER}"
    return f"({expr}) and {split}" if expr.strip() else split


def combined_exit(codes: dict) -> int:
    """The runner's exit status from the runs' ({name: pytest exit status}): 0 when each passed or collected nothing
    while another ran tests; else the first failure's status (NO_TESTS when every run collected nothing)."""
    if all(c == NO_TESTS for c in codes.values()):
        return NO_TESTS
    return next((c for c in codes.values() if c not in (0, NO_TESTS)), 0)


def summary_line(lines) -> str:
    """pytest's closing line (`=== 3 passed in 1.2s ===`, undecorated) from the last lines of a run's output."""
    for line in reversed(lines):
        text = line.strip().strip("=").strip()
        if text:
            return text
    return "(no output)"


class Run:
    """One pytest subprocess in a process group of its own, its output copied line by line with a prefix."""

    def __init__(self, name: str, cmd: list, env: dict, out, lock: threading.Lock):
        self.name, self.cmd, self.out, self.lock = name, cmd, out, lock
        self.prefix = f"[{name}]".ljust(7).encode()
        self.tail = collections.deque(maxlen=20)
        self.start = time.monotonic()
        self.wall_s = None
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.reader = threading.Thread(target=self._copy, name=f"run-{name}", daemon=True)
        self.reader.start()

    def _copy(self) -> None:
        for line in iter(self.proc.stdout.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            self.tail.append(line.decode(errors="replace"))
            with self.lock:
                self.out.write(self.prefix + line)
                self.out.flush()

    def poll(self):
        """The run's exit status, or None while it runs (its wall time is taken when it is first seen ended)."""
        rc = self.proc.poll()
        if rc is not None and self.wall_s is None:
            self.wall_s = time.monotonic() - self.start
        return rc

    def wait(self, timeout_s: float = None) -> int:
        self.proc.wait(timeout_s)
        return self.poll()

    def signal(self, sig: int) -> None:
        """Send `sig` to the run's process group (pytest and what it started), if the run has not ended."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


class _Terminated(Exception):
    pass


def _on_sigterm(signum, frame):
    raise _Terminated()


def run_split(expr: str, args: list) -> int:
    """The two runs started together; their combined exit status (combined_exit)."""
    out = sys.stdout.buffer
    extra = ["--color=yes"] if sys.stdout.isatty() and not any(a.startswith("--color") for a in args) else []
    env = dict(os.environ)
    env.setdefault("COLUMNS", str(max(60, shutil.get_terminal_size().columns - 7)))  # room for the prefix
    lock, runs = threading.Lock(), []
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        for name in ("ray", "rest"):
            cmd = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-m", run_expr(expr, name), *extra, *args]
            runs.append(Run(name, cmd, {**env, RUN_ENV: name}, out, lock))
        while None in [r.poll() for r in runs]:  # each polled every time: its wall time
            time.sleep(POLL_S)
        codes = {r.name: r.poll() for r in runs}
    except (KeyboardInterrupt, _Terminated) as e:
        sig = signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM
        print(f"\nrun_suite: stopping the runs ({signal.Signals(sig).name}; again to kill them)", flush=True)
        for r in runs:
            r.signal(sig)
        deadline = time.monotonic() + STOP_GRACE_S
        try:
            for r in runs:
                r.wait(max(0.1, deadline - time.monotonic()))
        except (KeyboardInterrupt, _Terminated, subprocess.TimeoutExpired):
            pass
        for r in runs:
            r.signal(signal.SIGKILL)
            r.wait()
            r.reader.join(5)
        return 130 if sig == signal.SIGINT else 143
    for r in runs:
        r.reader.join(10)
    rc = combined_exit(codes)
    with lock:
        print("\nrun_suite: " + ("passed" if rc == 0 else "FAILED"), flush=True)
        for r in runs:
            code = codes[r.name]
            note = ""
            if code == NO_TESTS:
                note = " (no test of this kind in the selection)" if rc != NO_TESTS else " (nothing collected)"
            print(f"  {r.name:<5} exit {code}{note}, {r.wall_s:.1f} s: {summary_line(r.tail)}    "
                  f"[-m \"{run_expr(expr, r.name)}\"]", flush=True)
    return rc


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description="Run the test suite as two pytest runs started together: the "
                                                 "tests that start Ray or Serve, one after another, and the rest.",
                                     epilog="Arguments after -- go to both pytest runs.")
    parser.add_argument("--workers", type=int, choices=(0, 1, 2), default=2,
                        help="2: the two runs together (default); 0 or 1: everything in one plain pytest process")
    parser.add_argument("-m", dest="markexpr", default="", help="the marker expression both runs share")
    args = parser.parse_args(own)
    user_expr, pytest_args = take_markexpr(pytest_args)
    expr = args.markexpr if user_expr is None else user_expr
    if args.workers < 2:
        os.environ.pop(RUN_ENV, None)
        cmd = [sys.executable, "-m", "pytest", "-p", "no:xdist", *(["-m", expr] if expr else []), *pytest_args]
        print(shlex.join(cmd), flush=True)
        os.execv(sys.executable, cmd)
    return run_split(expr, pytest_args)


if __name__ == "__main__":
    sys.exit(main())
