#!/usr/bin/env bash
# Installs the real Prometheus and Alertmanager (with promtool and amtool) that the tests and the
# demo run, Chromium (the demo test opens the HTML report in it, headless) and nginx (a router
# the tests put in front of vLLM: tests/test_routers.py), from Debian's packages, when they are
# missing. Needs root (apt-get).
set -euo pipefail

missing=()
command -v prometheus >/dev/null || missing+=(prometheus)
command -v promtool >/dev/null || missing+=(prometheus)
command -v prometheus-alertmanager >/dev/null || missing+=(prometheus-alertmanager)
command -v amtool >/dev/null || missing+=(prometheus-alertmanager)
command -v chromium >/dev/null || missing+=(chromium)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install-system-deps: need root to apt-get install ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# The packages' own services must not start: the tests and the demo start their own processes.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy"
  chmod +x "$policy"
  created_policy=1
fi
apt-get install -y -qq --no-install-recommends $(printf '%s\n' "${missing[@]}" | sort -u) >/dev/null
if [ "$created_policy" -eq 1 ]; then rm -f "$policy"; fi
prometheus --version 2>&1 | head -1
prometheus-alertmanager --version 2>&1 | head -1
"$(command -v nginx || echo /usr/sbin/nginx)" -v 2>&1 | head -1
