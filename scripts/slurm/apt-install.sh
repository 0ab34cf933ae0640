#!/usr/bin/env bash
# Install Debian packages for the test cluster without starting their services (as root): the test setup starts
# what it needs itself (scripts/slurm/start.sh the Slurm daemons, tests/test_slurm_ssh.py its own sshd on
# loopback), and a system sshd on port 22 is not wanted on a CI machine. Packages already installed are skipped.
#
#   sudo scripts/slurm/apt-install.sh slurm-wlm munge openssh-server rsync
set -euo pipefail

die() { echo "slurm/apt-install.sh: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root: sudo $0 $*"
missing=()
for package in "$@"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
[ ${#missing[@]} -gt 0 ] || exit 0

echo "slurm/apt-install.sh: installing ${missing[*]} (apt-get)"
export DEBIAN_FRONTEND=noninteractive
log=/tmp/fp8-recipes-apt.log
apt-get update -qq >"$log" 2>&1 || { cat "$log" >&2; die "apt-get update failed"; }
# policy-rc.d 101: the packages must not start their services themselves.
made_policy=
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
fi
apt-get install -y -qq --no-install-recommends "${missing[@]}" >>"$log" 2>&1 \
    || { cat "$log" >&2; [ -z "$made_policy" ] || rm -f /usr/sbin/policy-rc.d; die "apt-get install ${missing[*]} failed"; }
[ -z "$made_policy" ] || rm -f /usr/sbin/policy-rc.d
