#!/bin/sh
# Install the system packages the integration tests need: slurmctld, slurmd, the client
# commands and munge (the SLURM tests), and iproute2 (`ip netns`: the multi-node tests run
# each node in a network namespace). Idempotent: does nothing if they are present.
# Without root or without apt-get it only says what is missing and exits 0 (those tests
# then skip themselves with the reason); exits 1 only if apt-get fails.
set -u
PATH="$PATH:/usr/sbin:/sbin"  # the daemons and ip live in sbin, often not on a user's PATH

missing=""
packages=""
for cmd in slurmctld slurmd sbatch munged; do
    command -v "$cmd" >/dev/null 2>&1 || missing="$missing $cmd"
done
[ -n "$missing" ] && packages=" slurm-wlm munge"
if ! command -v ip >/dev/null 2>&1; then
    missing="$missing ip"
    packages="$packages iproute2"
fi
if [ -z "$missing" ]; then
    echo "install_system_deps: slurm-wlm, munge and iproute2 already installed"
    exit 0
fi
echo "install_system_deps: missing:$missing"

if [ "$(id -u)" -ne 0 ]; then
    echo "install_system_deps: not root, not installing (run as root: apt-get install -y$packages)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_system_deps: apt-get not available, not installing$packages"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
# shellcheck disable=SC2086  # the package list is meant to be split
if apt-get update -qq && apt-get install -y -qq --no-install-recommends $packages; then
    echo "install_system_deps: installed$packages"
else
    echo "install_system_deps: apt-get failed" >&2
    exit 1
fi
exit 0
