#!/bin/sh
# Install the system packages the SLURM integration tests need (slurmctld, slurmd,
# the client commands and munge). Idempotent: does nothing if they are present.
# Without root or without apt-get it only says what is missing and exits 0 (the
# SLURM tests then skip themselves with the reason); exits 1 only if apt-get fails.
set -u
PATH="$PATH:/usr/sbin:/sbin"  # the daemons live in sbin, often not on a user's PATH

missing=""
for cmd in slurmctld slurmd sbatch munged; do
    command -v "$cmd" >/dev/null 2>&1 || missing="$missing $cmd"
done
if [ -z "$missing" ]; then
    echo "install_system_deps: slurm-wlm and munge already installed"
    exit 0
fi
echo "install_system_deps: missing:$missing"

if [ "$(id -u)" -ne 0 ]; then
    echo "install_system_deps: not root, not installing (run as root: apt-get install -y slurm-wlm munge)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_system_deps: apt-get not available, not installing slurm-wlm and munge"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
if apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge; then
    echo "install_system_deps: installed slurm-wlm and munge"
else
    echo "install_system_deps: apt-get failed" >&2
    exit 1
fi
exit 0
