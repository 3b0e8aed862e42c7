#!/usr/bin/env bash
# mypy over the package as installed. In the checkout, pyproject's package-dir mapping puts
# src/oomguard/exporter/ at oomguard.exporter, which mypy cannot follow; a non-editable install has the real
# layout. Builds the wheel from a copy of the sources, installs it with mypy into a temporary venv
# and checks that copy. Needs PyPI (mypy). Not part of `make check` until it is clean.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
quiet() { "$@" 2>&1 | sed -e "/^WARNING: Location 'file:/d"; }
mkdir "$tmp/src"
git ls-files -z --cached --others --exclude-standard \
  | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$tmp/src"
python3 -m venv "$tmp/venv"
quiet "$tmp/venv/bin/pip" install -q build 'setuptools>=77'
quiet "$tmp/venv/bin/python" -m build --wheel --no-isolation --outdir "$tmp/dist" "$tmp/src" | tail -3
wheel=$(echo "$tmp"/dist/oomguard-*.whl)
quiet "$tmp/venv/bin/pip" install -q -c requirements/lock.txt "$wheel[all]" 'mypy>=1.10' types-PyYAML
mkdir "$tmp/check"
cp -r "$tmp"/venv/lib/python3*/site-packages/oomguard "$tmp/check/"
cd "$tmp/check"
"$tmp/venv/bin/mypy" --config-file "$repo/pyproject.toml" --python-executable "$tmp/venv/bin/python" -p oomguard
