#!/usr/bin/env bash
# Installs what the tests need (gdb for the injector, the package with its test extra) and runs them.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v gdb >/dev/null 2>&1; then
  echo "tests/run.sh: installing gdb (needed by probe PID inject)" >&2
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq gdb >/dev/null) || echo "tests/run.sh: could not install gdb; injection tests will skip" >&2
  elif command -v sudo >/dev/null 2>&1; then
    (sudo apt-get update -qq && sudo apt-get install -y -qq gdb >/dev/null) || echo "tests/run.sh: could not install gdb; injection tests will skip" >&2
  else
    echo "tests/run.sh: not root and no sudo: injection tests will skip" >&2
  fi
fi

# A one-node Slurm for tests/test_slurm.py (srun, probe slurm:JOBID): Debian's slurm-wlm and munge, as root.
if ! { command -v srun && command -v scontrol && command -v squeue && [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] \
       && [ -x /usr/sbin/munged ]; } >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "tests/run.sh: installing slurm-wlm and munge (a one-node Slurm for the srun tests)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null) \
      || echo "tests/run.sh: could not install slurm-wlm and munge; the Slurm tests will skip" >&2
  else
    echo "tests/run.sh: no slurm-wlm and munge, and not root with apt-get: the Slurm tests will skip" >&2
  fi
fi

# Open MPI's mpirun for tests/test_every_launcher.py (mpirun -np 4 as root, with its flags for that).
if ! command -v mpirun >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "tests/run.sh: installing openmpi-bin (mpirun for the MPI launcher test)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin >/dev/null) \
      || echo "tests/run.sh: could not install openmpi-bin; the mpirun tests will skip" >&2
  else
    echo "tests/run.sh: no mpirun, and not root with apt-get: the mpirun tests will skip" >&2
  fi
fi

# Prometheus and promtool for tests/test_metrics.py (a real server scraping a torchrun job; the shipped rules checked).
if ! { command -v prometheus && command -v promtool; } >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "tests/run.sh: installing prometheus (the metrics tests' server and promtool)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
      || echo "tests/run.sh: could not install prometheus; the metrics tests that need it will skip" >&2
  else
    echo "tests/run.sh: no prometheus, and not root with apt-get: the metrics tests that need it will skip" >&2
  fi
fi

# Headless browsers for tests/test_page.py (the page of `probe ... page`): Debian's Chromium and its driver,
# driven by selenium (in the test extra; nothing is downloaded by selenium itself), and Debian's Firefox ESR,
# driven over its own Marionette protocol (Debian packages no geckodriver).
if ! { { command -v chromium || command -v chromium-browser; } && command -v chromedriver && command -v firefox-esr; } \
     >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "tests/run.sh: installing chromium, chromium-driver and firefox-esr (headless browsers for the page's tests)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver firefox-esr \
      >/dev/null) || echo "tests/run.sh: could not install chromium, chromium-driver and firefox-esr; the page's browser tests will skip" >&2
  else
    echo "tests/run.sh: no chromium with chromedriver or no firefox-esr, and not root with apt-get: the page's browser tests will skip" >&2
  fi
fi

python -m pip install -q -e '.[test]'
# On two workers (pytest-xdist), a module whole on each (its module fixtures are shared by its tests), the
# slowest modules first (tests/conftest.py): most of the suite waits on real child processes.
# PROBE_TEST_WORKERS=0 runs it in this process, one test after another.
exec python -m pytest -q -n "${PROBE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
