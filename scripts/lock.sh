#!/usr/bin/env bash
# Rewrites requirements/lock.txt from an environment that passes `make test` (default .venv):
# every installed distribution at its exact version, except pip and oomguard itself. The local
# version label of the CPU torch (+cpu) is dropped so the lock also installs where only PyPI's
# torch exists.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
{
  sed -n '1,/^[^#]/{/^#/p}' requirements/lock.txt
  "$venv/bin/python" -m pip freeze --all --exclude-editable 2>/dev/null \
    | grep -v -i -e '^pip==' -e '^oomguard==' \
    | sed -e 's/^\(torch==[^+]*\)+.*/\1/' \
    | LC_ALL=C sort -f
} > requirements/lock.txt.new
mv requirements/lock.txt.new requirements/lock.txt
echo "wrote requirements/lock.txt ($(grep -c '==' requirements/lock.txt) packages)"
