# Sourced by scripts/serve and scripts/test: make .venv hold exactly requirements.txt, and labkit
# (code/labkit) installed in editable mode, so that labs, notebooks, benchmarks and tests import it
# without touching sys.path.
#
# The Python is $PYTHON (default: python3): 3.11 or newer, Debian 12's own 3.11.2 included. .venv is
# trusted only when its marker names the same requirements, the same pyproject.toml and the same
# Python; otherwise it is removed and made again. The marker is written last, after every install
# has succeeded, so a failed or interrupted install never leaves a .venv that the next run trusts.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
VENV=".venv"
MIN_PYTHON="3.11"  # pyproject.toml's requires-python; tests/test_setup.py holds the two equal

# One line, with the fix, when the Python is missing or too old. Any Python can run this check.
if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
  found="$("$PYTHON" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null || true)"
  echo "InfraLab needs Python $MIN_PYTHON or newer; '$PYTHON' is ${found:-not a Python that runs here}:" \
    "install python3.11 (or newer) and run again with PYTHON=/path/to/python3.11 $0" >&2
  exit 2
fi
[ "${INFRALAB_CHECK_PYTHON_ONLY:-}" = 1 ] && return 0  # tests/test_setup.py: the check alone

python_id="$("$PYTHON" -c 'import sys; print(sys.executable, "%d.%d.%d" % sys.version_info[:3])')"
want="$( (cat requirements.txt pyproject.toml; echo "$python_id") | sha256sum | cut -d' ' -f1)"
have="$(cat "$VENV/.requirements.sha256" 2>/dev/null || true)"

if [ "$want" != "$have" ]; then
  if [ -e "$VENV" ]; then
    echo "$VENV was made for other requirements or another Python, or its install did not finish: making it again" >&2
    rm -rf "$VENV"
  fi
  if ! "$PYTHON" -m venv "$VENV" 2>/dev/null; then
    rm -rf "$VENV"
    # Debian ships venv separately; as root, install it and try again.
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
      "$PYTHON" -m venv "$VENV"
    else
      echo "cannot create $VENV with '$PYTHON': install your distribution's python3-venv package" >&2
      exit 2
    fi
  fi
  echo "installing pinned dependencies into $VENV with $python_id (first run only; torch is the large one)" >&2
  # pip first, at its pinned version: the install below then resolves the same way on every Python
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$(grep -E '^pip==' requirements.txt)"
  "$VENV/bin/python" -m pip install --disable-pip-version-check -r requirements.txt
  # labkit, editable: the venv's own setuptools builds it (pinned in requirements.txt), no download
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
  echo "$want" > "$VENV/.requirements.sha256"
fi

export NO_MKDOCS_2_WARNING=1
