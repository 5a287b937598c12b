"""The dependency lock, constraints.txt (no network, nothing installed):

- it is well formed: one `name==version` a line, each name once, none of the packages it must leave alone (torch,
  which TORCH_SPEC installs; pip, setuptools, wheel; the project's own editable packages);
- every requirement of pyproject.toml (its dependencies and the extras `make setup` installs) and of
  device/pyproject.toml is pinned there, and the pin lies within the declared range;
- the running interpreter has exactly the pinned versions, and every package the project's requirements pull in
  (followed through the installed metadata, not into torch) is pinned: a lock and a .venv that drifted apart fail
  here, saying to run `make setup` (install the pins) or `make lock` (move the lock on).

This file is also the lock's generator, so the lock and its test agree on what it covers. `make lock` runs it on a
fresh resolution in a throwaway venv:

    python tests/test_lock.py --report REPORT.json --out constraints.txt   # REPORT: pip install --dry-run --report
    python tests/test_lock.py --installed --out constraints.txt            # or: lock what this interpreter has

It needs `packaging` alone (no torch, no pytest).
"""

import argparse
import importlib.metadata
import json
import os
import platform
import sys

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK = os.path.join(REPO, "constraints.txt")
# what the Makefile installs: `pip install -e ./device`, then `pip install -e ".[serve,load,test,export]"`
EXTRAS = ("serve", "load", "test", "export")
ROOTS = (("ciar", EXTRAS), ("ciar-device", ()))
OWN = {"ciar", "ciar-device"}
# torch (and what only torch needs: networkx here, nvidia-* and triton with CUDA builds) comes from the Makefile's
# TORCH_SPEC line, so the lock neither pins it nor follows its requirements; pip, setuptools and wheel are the venv's
TORCH = {"torch"}
NOT_PINNED = TORCH | OWN | {"pip", "setuptools", "wheel"}
FIX = ("run `make setup` to install the locked versions into .venv, or `make lock` to re-resolve the lock from "
       "pyproject.toml's ranges (then `make setup`)")

HEADER = """\
# The dependency lock: the exact version of every package `make setup` installs for the project, used as pip
# constraints by its two installs (`pip install -c constraints.txt -e ./device` and
# `pip install -c constraints.txt -e ".[serve,load,test,export]"`), so a fresh clone gets what the tests passed with.
# Generated, do not edit: `make lock` resolves pyproject.toml's and device/pyproject.toml's ranges afresh (together
# with TORCH_SPEC) in a throwaway venv under /tmp and rewrites this file, so the lock moves forward only on purpose;
# review `git diff constraints.txt`, then `make setup` and `make test`. tests/test_lock.py (run by `make test`) checks
# that every declared requirement is pinned here within its range and that .venv has exactly these versions.
# torch is deliberately NOT pinned here, nor what only torch needs (networkx; nvidia-* and triton with CUDA builds):
# the Makefile installs torch first by TORCH_SPEC (by default the pinned CPU wheel), and a torch pin here would make pip
# replace a GPU user's torch (`make setup TORCH_SPEC=torch`, or their own) with ours. Packages torch shares with the
# rest (sympy, filelock, fsspec, jinja2, typing-extensions, ...) are pinned, and installed torch must accept them.
# pip, setuptools and wheel are the venv's own and not pinned either.
"""


def _key(name: str) -> str:
    return canonicalize_name(name)  # PEP 503


def read_lock(path: str = LOCK) -> dict:
    """{canonical name: version} of the lock's `name==version` lines (comments and blank lines skipped)."""
    pins, problems = {}, []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                req = Requirement(line)
            except InvalidRequirement as e:
                problems.append(f"line {n}: {line!r} is not a requirement ({e})")
                continue
            specs = list(req.specifier)
            if req.extras or req.marker or req.url or len(specs) != 1 or specs[0].operator != "==" or \
                    "*" in specs[0].version:
                problems.append(f"line {n}: {line!r} is not a plain exact pin `name==version`")
                continue
            name = _key(req.name)
            if name in pins:
                problems.append(f"line {n}: {name} is pinned twice")
            pins[name] = specs[0].version
    assert not problems, f"{os.path.relpath(path, REPO)} is malformed:\n  " + "\n  ".join(problems)
    return pins


def _applies(req: Requirement, extra: str) -> bool:
    return req.marker is None or req.marker.evaluate({"extra": extra})


def closure(dists: dict, roots=ROOTS) -> tuple[dict, list]:
    """Follow the requirements from `roots` ((name, extras) pairs) through `dists` ({canonical name: (version,
    [requirement strings])}), markers evaluated for this interpreter, not into torch. Returns ({name: the first
    package that required it}, [problems: required but absent, or present at a version outside the range])."""
    reached, problems = {r: "(the project)" for r, _ in roots}, []
    done, stack = set(), [(_key(r), e) for r, e in roots]
    while stack:
        name, extras = stack.pop()
        if name in TORCH:
            continue
        version, requires = dists[name]
        for extra in ("",) + tuple(extras):
            if (name, extra) in done:
                continue
            done.add((name, extra))
            for line in requires:
                req = Requirement(line)
                if not _applies(req, extra):
                    continue
                dep = _key(req.name)
                reached.setdefault(dep, name)
                if dep not in dists:
                    problems.append(f"{dep} (required by {name}: {line}) is not installed")
                    continue
                if not req.specifier.contains(dists[dep][0], prereleases=True):
                    problems.append(f"{dep} {dists[dep][0]} is outside {name}'s requirement {line}")
                stack.append((dep, tuple(sorted(req.extras))))
    return reached, problems


def installed_dists() -> dict:
    """{canonical name: (version, requires)} of this interpreter's packages (the first of each name on sys.path,
    as importlib finds it)."""
    out = {}
    for d in importlib.metadata.distributions():
        name = d.metadata["Name"]
        if name and _key(name) not in out:
            out[_key(name)] = (d.version, list(d.requires or []))
    return out


def report_dists(path: str) -> dict:
    """The same from `pip install --dry-run --ignore-installed --report PATH`: what that resolution would install."""
    with open(path) as f:
        report = json.load(f)
    return {_key(item["metadata"]["name"]): (item["metadata"]["version"], list(item["metadata"].get("requires_dist")
                                                                                 or []))
            for item in report["install"]}


def render(dists: dict) -> str:
    """The lock file for `dists`: the pinnable packages the roots pull in, sorted by name."""
    reached, problems = closure(dists)
    if problems:
        raise SystemExit("the resolution is inconsistent:\n  " + "\n  ".join(problems))
    names = sorted(n for n in reached if n not in NOT_PINNED)
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    where = f"# Resolved for {platform.python_implementation()} {python} on {sys.platform} {platform.machine()}; " \
            f"its pins may need Python {python} or newer\n# (another Python: `make lock PYTHON=python3.X`).\n"
    return HEADER + where + "".join(f"{n}=={dists[n][0]}\n" for n in names)


# ---------------------------------------------------------------------------------------------------------------
# the tests


def _declared() -> list:
    """(file, requirement) for every requirement the two pyproject.toml files declare for what `make setup` installs
    (from the files themselves; from the installed metadata where no TOML reader exists, Python 3.10)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the metadata of the installed editable packages (as of the last `make setup`)
        return [(f"{name} (installed metadata)", Requirement(r)) for name, extras in ROOTS
                for r in importlib.metadata.requires(name) or []
                if any(_applies(Requirement(r), e) for e in ("",) + extras)]
    out = []
    for rel, extras in (("pyproject.toml", EXTRAS), (os.path.join("device", "pyproject.toml"), ())):
        with open(os.path.join(REPO, rel), "rb") as f:
            project = tomllib.load(f)["project"]
        lines = list(project.get("dependencies", []))
        optional = project.get("optional-dependencies", {})
        for extra in extras:
            assert extra in optional, f"{rel} has no extra {extra!r}, which the Makefile installs"
            lines += optional[extra]
        out += [(rel, Requirement(line)) for line in lines]
    return out


def test_lock_is_well_formed_and_leaves_torch_to_torch_spec():
    pins = read_lock()
    assert len(pins) > 50, "constraints.txt pins almost nothing: run `make lock`"
    wrong = sorted(set(pins) & NOT_PINNED)
    assert not wrong, f"constraints.txt must not pin {wrong}: torch comes from the Makefile's TORCH_SPEC (GPU users " \
                      f"bring their own), pip/setuptools/wheel are the venv's, ciar and ciar-device are this checkout"


def test_every_declared_requirement_is_pinned_within_its_range():
    pins, problems = read_lock(), []
    for where, req in _declared():
        name = _key(req.name)
        if name in NOT_PINNED or (req.marker is not None and not any(_applies(req, e) for e in ("",) + EXTRAS)):
            continue
        if name not in pins:
            problems.append(f"{where}: {req} is not pinned in constraints.txt")
        elif not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{where}: {req} does not admit the pin {name}=={pins[name]}")
    assert not problems, "the lock does not cover the declared requirements (run `make lock`, then " \
                         "`make setup`):\n  " + "\n  ".join(problems)


def test_installed_versions_are_the_locked_ones():
    pins, dists = read_lock(), installed_dists()
    for name in OWN:
        assert name in dists, f"{name} is not installed in this interpreter ({sys.executable}): run `make setup`"
    reached, problems = closure(dists)
    for name in sorted(reached):
        if name not in NOT_PINNED and name in dists and name not in pins:
            problems.append(f"{name} {dists[name][0]} (required by {reached[name]}) is not in constraints.txt")
    for name, pin in sorted(pins.items()):
        if name in dists and Version(dists[name][0]) != Version(pin):
            problems.append(f"{name}: installed {dists[name][0]}, locked {pin}")
    assert not problems, f"this interpreter ({sys.executable}) and constraints.txt disagree; {FIX}:\n  " + \
                         "\n  ".join(problems)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Write the dependency lock (constraints.txt).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--report", help="a `pip install --dry-run --ignore-installed --report` of the project")
    source.add_argument("--installed", action="store_true", help="lock what this interpreter has installed")
    parser.add_argument("--out", default="-", help="the file to write (default: standard output)")
    args = parser.parse_args(argv)
    text = render(report_dists(args.report) if args.report else installed_dists())
    if args.out == "-":
        sys.stdout.write(text)
        return
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, args.out)
    pins = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    print(f"lock: wrote {args.out} ({pins} pins)")


if __name__ == "__main__":
    main()
