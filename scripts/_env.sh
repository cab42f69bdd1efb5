# Sourced by scripts/serve and scripts/test: make .venv hold exactly requirements.txt, and labkit
# (code/labkit) installed in editable mode, so that labs, notebooks, benchmarks and tests import it
# without touching sys.path. Creates the virtual environment on first use and reinstalls only when
# requirements.txt or pyproject.toml changes.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
VENV=".venv"

if ! "$PYTHON" -c 'import sys; raise SystemExit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "InfraLab needs Python 3.11 or newer as '$PYTHON' (set PYTHON=/path/to/python3.11)." >&2
  exit 2
fi

if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PYTHON" -m venv "$VENV" 2>/dev/null; then
    # Debian ships venv separately; as root, install it and try again.
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      rm -rf "$VENV"
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
      "$PYTHON" -m venv "$VENV"
    else
      echo "cannot create $VENV: install your distribution's python3-venv package" >&2
      exit 2
    fi
  fi
fi

want="$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
have="$(cat "$VENV/.requirements.sha256" 2>/dev/null || true)"
if [ "$want" != "$have" ]; then
  echo "installing pinned dependencies into $VENV (first run only; torch is the large one)" >&2
  "$VENV/bin/python" -m pip install --disable-pip-version-check -r requirements.txt
  # labkit, editable: the venv's own setuptools builds it (torch requires setuptools), no download
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
  echo "$want" > "$VENV/.requirements.sha256"
fi

export NO_MKDOCS_2_WARNING=1
