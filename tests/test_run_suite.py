"""tests/run_suite.py, `make test`'s runner: the marker expressions of its two runs, how their exit statuses combine,
and, on a throwaway suite of its own (no torch, no Ray: a few seconds), its prefixed output, its exit status when a
run fails or collects nothing, and Ctrl-C passed on to the runs' process groups."""

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_suite.py")
_spec = importlib.util.spec_from_file_location("run_suite", RUNNER)
run_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_suite)


@pytest.mark.parametrize("args, expr, rest", [
    (["tests/a.py", "-x"], None, ["tests/a.py", "-x"]),
    (["-m", "slow", "tests/a.py"], "slow", ["tests/a.py"]),
    (["-mslow", "-m", "gpu"], "gpu", []),
    (["--markexpr", "not gpu", "-k", "x"], "not gpu", ["-k", "x"]),
    (["--markexpr=slow or gpu"], "slow or gpu", []),
])
def test_a_marker_expression_among_the_pytest_arguments_is_taken_out(args, expr, rest):
    assert run_suite.take_markexpr(args) == (expr, rest)


def test_the_two_runs_split_the_expression_on_the_marker():
    assert run_suite.run_expr("not slow and not gpu", "ray") == "(not slow and not gpu) and ray_serial"
    assert run_suite.run_expr("slow or gpu", "rest") == "(slow or gpu) and not ray_serial"
    assert run_suite.run_expr("", "rest") == "not ray_serial"


@pytest.mark.parametrize("ray, rest, combined", [
    (0, 0, 0),
    (5, 0, 0),  # the selection holds no Ray test (e.g. PYTEST_ARGS=tests/test_lock.py)
    (0, 5, 0),
    (5, 5, 5),  # nothing collected at all: fails
    (1, 0, 1),
    (0, 1, 1),
    (5, 2, 2),
    (1, 4, 1),
])
def test_the_runner_fails_when_either_run_fails_or_both_collect_nothing(ray, rest, combined):
    assert run_suite.combined_exit({"ray": ray, "rest": rest}) == combined


def test_the_summary_is_the_last_line_undecorated():
    assert run_suite.summary_line(["x\n", "=== 3 passed in 1.2s ===\n", "\n"]) == "3 passed in 1.2s"
    assert run_suite.summary_line([]) == "(no output)"


# ---------------------------------------------------------------------------------------------------------------
# the runner on a suite of its own (a pytest.ini and marked tests in a temporary folder)

SUITE = {
    "pytest.ini": """\
        [pytest]
        addopts = --strict-markers
        markers =
            ray_serial: the ray run's tests
        """,
    "test_ray.py": """\
        import pytest

        pytestmark = pytest.mark.ray_serial


        def test_in_the_ray_run():
            pass
        """,
    "test_rest.py": """\
        def test_in_the_rest_run():
            pass


        def test_that_fails():
            assert 1 == 2
        """,
}


@pytest.fixture
def suite(tmp_path):
    for name, text in SUITE.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    return tmp_path


def _env() -> dict:
    """This environment for the runner, without pytest options and without the installed plugins (faster starts)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "COLUMNS")}
    return {**env, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


HANG_S = 600  # a guard against a runner that never ends, not an expectation of speed (each run takes seconds)


def _runner(folder, *pytest_args):
    return subprocess.run([sys.executable, RUNNER, "--", "-p", "no:cacheprovider", *pytest_args], cwd=folder,
                          env=_env(), capture_output=True, text=True, timeout=HANG_S)


def test_both_runs_are_prefixed_and_one_failure_fails_the_runner(suite):
    r = _runner(suite)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert any(line.startswith("[ray]  ") and "1 passed" in line for line in lines), r.stdout
    assert any(line.startswith("[rest] ") and "1 failed, 1 passed" in line for line in lines), r.stdout
    assert "run_suite: FAILED" in r.stdout
    assert any(line.startswith("  rest  exit 1, ") for line in lines), r.stdout


def test_a_run_with_nothing_selected_passes_beside_one_that_ran_and_fails_alone(suite):
    r = _runner(suite, "test_rest.py::test_in_the_rest_run")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ray   exit 5 (no test of this kind in the selection)" in r.stdout
    r = _runner(suite, "-k", "no_such_test")
    assert r.returncode == 5, r.stdout + r.stderr
    assert "run_suite: FAILED" in r.stdout and "(nothing collected)" in r.stdout


def test_ctrl_c_stops_both_runs(suite):
    (suite / "test_rest.py").write_text(textwrap.dedent("""\
        import os
        import time


        def test_waits():
            open(f"started-{os.getpid()}", "w").close()
            time.sleep(600)
        """))
    (suite / "test_ray.py").write_text((suite / "test_rest.py").read_text().replace(
        "import time\n", "import time\n\nimport pytest\n\npytestmark = pytest.mark.ray_serial\n"))
    proc = subprocess.Popen([sys.executable, RUNNER, "--", "-p", "no:cacheprovider"], cwd=suite, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # until both runs are inside their test (however long their start takes), or the runner ended early
        while len(list(suite.glob("started-*"))) < 2 and proc.poll() is None:
            time.sleep(0.1)
        pids = [int(p.name.split("-")[1]) for p in suite.glob("started-*")]
        assert len(pids) == 2, "the runner ended before both runs started their tests"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=HANG_S)  # (the runner kills its runs STOP_GRACE_S after the signal)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "run_suite: stopping the runs (SIGINT" in out
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
