#!/usr/bin/env bash
# The Python for the tests: one that imports torch and pytest. Prints its path (the last line on stdout; messages go
# to stderr), setting it up when there is none. scripts/setup.sh calls it; python/tests/run.sh uses what it prints.
#   scripts/python-env.sh
# Nothing is installed into the system's Python. In order:
#   1. .venv/ of an earlier run, when it still imports both;
#   2. a Python that already has both: /opt/torch/.venv/bin/python (the GPU machines, which have no network), then
#      python3. It is used as it is, nothing is created;
#   3. a Python that has torch but not pytest: .venv/ is created with that Python, sees its packages (a .pth file)
#      and gets pytest;
#   4. else .venv/ is created with python3 and gets torch (PyPI's default Linux wheel, a CUDA build of ~5 GB with its
#      nvidia-* packages: about a minute on the CI machines; a CPU build is enough for the tests), numpy and pytest.
#      pip keeps no cache (the wheels would take ~3 GB more); with less than ~6 GB free it says so before it starts.
#      EPX_TORCH_INDEX_URL: a pip index to take torch from instead (PyTorch's CPU-only index, ~200 MB, where it is
#      reachable).
# Where nothing could be set up it prints python3 and exits 1 (the tests then run without torch, or fail in CI).
# EPX_PYTHON_ENV=0 (setup.sh) skips all of this.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=$PWD/.venv
PIP_LIMIT_S=${EPX_PIP_TIMEOUT_S:-900}  # the whole install; CI must stay well under 20 minutes
say() { echo "python-env: $*" >&2; }
has() { "$1" -c "import $2" >/dev/null 2>&1; }
pip_in() {  # pip_in PYTHON ARGS...: short network timeouts, so that a machine without network gives up quickly
  local py=$1
  shift
  timeout "$PIP_LIMIT_S" "$py" -m pip install --quiet --disable-pip-version-check --no-cache-dir --timeout 30 \
    --retries 2 "$@" >&2
}
free_gb() { df -Pk "$PWD" 2>/dev/null | awk 'NR == 2 { printf "%.1f", $4 / 1048576 }'; }

if [ -x "$VENV/bin/python" ] && has "$VENV/bin/python" torch && has "$VENV/bin/python" pytest; then
  echo "$VENV/bin/python"
  exit 0
fi

candidates=()
for py in /opt/torch/.venv/bin/python python3; do
  command -v "$py" >/dev/null 2>&1 && candidates+=("$(command -v "$py")")
done
for py in "${candidates[@]}"; do
  if has "$py" torch && has "$py" pytest; then
    echo "$py"
    exit 0
  fi
done

if ! command -v python3 >/dev/null 2>&1; then
  say "no python3 here: the Python tests cannot run"
  echo python3
  exit 1
fi

# A venv needs ensurepip (Debian: python3-venv).
ensure_venv_support() {
  has "$1" ensurepip && return 0
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "installing python3-venv"
    apt-get update -qq >/dev/null 2>&1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null 2>&1
  fi
  has "$1" ensurepip || { say "$1 cannot create a virtual environment (no ensurepip; install python3-venv)"; return 1; }
}
make_venv() {  # make_venv PYTHON: a fresh .venv made with PYTHON
  rm -rf "$VENV"
  ensure_venv_support "$1" && "$1" -m venv "$VENV" >&2
}

for py in "${candidates[@]}"; do
  has "$py" torch || continue
  # torch is here but pytest is not: a venv of the same Python that sees torch's site-packages, plus pytest.
  say "$py has torch but not pytest: setting up $VENV with access to its packages"
  site=$("$py" -c "import sysconfig; print(sysconfig.get_path('purelib')); print(sysconfig.get_path('platlib'))")
  if make_venv "$py"; then
    vsite=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
    printf '%s\n' "$site" | sort -u >"$vsite/epx-torch-site.pth"
    if pip_in "$VENV/bin/python" pytest && has "$VENV/bin/python" torch && has "$VENV/bin/python" pytest; then
      echo "$VENV/bin/python"
      exit 0
    fi
  fi
  say "could not install pytest (no network?)"
  rm -rf "$VENV"
  echo "$py"
  exit 1
done

say "setting up $VENV with torch, numpy and pytest (a first run downloads torch: ~5 GB from PyPI)"
free=$(free_gb)
if [ -z "${EPX_TORCH_INDEX_URL:-}" ] && [ -n "$free" ] && awk -v f="$free" 'BEGIN { exit !(f < 6) }'; then
  say "only ${free} GB free on $PWD's disk; torch with its nvidia-* packages needs ~5.5 GB:" \
    "the install may fail"
fi
start=$SECONDS
if ! make_venv python3; then
  echo python3
  exit 1
fi
if [ -n "${EPX_TORCH_INDEX_URL:-}" ]; then
  installed() { pip_in "$VENV/bin/python" --index-url "$EPX_TORCH_INDEX_URL" torch && pip_in "$VENV/bin/python" numpy pytest; }
else
  installed() { pip_in "$VENV/bin/python" torch numpy pytest; }
fi
if ! installed; then
  say "could not install torch, numpy and pytest into $VENV" \
    "(no network? over ${PIP_LIMIT_S} s? disk full? $(free_gb) GB free now)"
  rm -rf "$VENV"
  echo python3
  exit 1
fi
say "$VENV is ready ($((SECONDS - start)) s; $(du -sh "$VENV" 2>/dev/null | cut -f1))"
echo "$VENV/bin/python"
