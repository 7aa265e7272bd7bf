"""nox sessions for the torchloom workspace.

Each unit and mypy session syncs only one workspace member (plus the root's dev
group) into its own virtual environment with ``uv sync --locked --package``, so
an import of an undeclared sibling fails there. ``nox`` with no arguments runs
every session that needs no GPU; the ``gpu`` tier runs through
``scripts/gpu_tier.sh`` on the GPU machine.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = False

PYTHON = ["3.11"]

# folder under packages/ -> distribution name
PACKAGES: dict[str, str] = {
    "sidefx": "torchloom-sidefx",
    "cells": "torchloom-cells",
    "hops": "torchloom-hops",
    "resize": "torchloom-resize",
    "cudagraph": "torchloom-cudagraph",
    "cache": "torchloom-cache",
    "torchloom": "torchloom",
}


def _sync(session: nox.Session, *args: str) -> None:
    env = {"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}
    groups = args if "--only-group" in args else ("--group", "dev", *args)
    session.run_install("uv", "sync", "--locked", *groups, env=env)


def _pytest_env() -> dict[str, str]:
    # Verifiers (graph lint, plan checks) run on every pass inside tests.
    return {"TORCHLOOM_CHECKS": "1", "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}


for _folder, _dist in PACKAGES.items():

    def _unit(session: nox.Session, folder: str = _folder, dist: str = _dist) -> None:
        _sync(session, "--package", dist)
        session.run(
            "pytest",
            f"packages/{folder}/tests",
            "-m",
            "not gpu and not multigpu",
            *session.posargs,
            env=_pytest_env(),
        )

    def _mypy(session: nox.Session, folder: str = _folder, dist: str = _dist) -> None:
        _sync(session, "--package", dist)
        session.run("mypy", f"packages/{folder}/src")

    nox.session(name=f"unit-{_folder}", python=PYTHON)(_unit)
    nox.session(name=f"mypy-{_folder}", python=PYTHON)(_mypy)


@nox.session(python=PYTHON)
def integration(session: nox.Session) -> None:
    """The backend end to end against eager, on CPU."""
    _sync(session, "--all-packages")
    session.run(
        "pytest",
        "tests_integration",
        "-m",
        "not gpu and not multigpu",
        *session.posargs,
        env=_pytest_env(),
    )


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    _sync(session, "--only-group", "dev")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
