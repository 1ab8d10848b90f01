#!/usr/bin/env bash
# The newest-packages check (not CI): install moesim with its test extras into a fresh venv
# WITHOUT .ci/constraints.txt (torch stays the pinned CPU build: an unpinned one is a CUDA
# build of several GB), print every package whose version moved from the constraints, then
# run the default suite. A family a new transformers adds is a warning there (and checked by
# tests/test_families.py), not a failure; anything else that fails is what to fix before
# regenerating the constraints.
#   bash bench/newest_packages.sh [VENV_DIR]      (default: a temporary folder, removed after)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-$(mktemp -d)/venv}"
python -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
unset PIP_CONSTRAINT
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet --upgrade -e ".[test,distributed]"
python - <<'PY'
import importlib.metadata as md
from pathlib import Path

pinned = {}
for line in Path(".ci/constraints.txt").read_text().splitlines():
    if "==" in line and not line.startswith("#"):
        name, version = line.split("==")
        pinned[name.strip().lower().replace("_", "-")] = version.strip()
moved = []
for dist in md.distributions():
    name = dist.metadata["Name"].lower().replace("_", "-")
    version = dist.version.split("+")[0]
    if name in pinned and pinned[name] != version:
        moved.append(f"{name} {pinned[name]} -> {version}")
    elif name not in pinned and name not in ("moesim", "pip", "setuptools", "wheel"):
        moved.append(f"{name} (new) {version}")
print("moved since .ci/constraints.txt:", "; ".join(sorted(moved)) or "nothing")
PY
MPLBACKEND=Agg python -m pytest -q
