#!/usr/bin/env bash
# Rewrites requirements/vllm-0.33-env.txt: what pip resolves for `vllm==0.33.0` on Linux x86_64,
# Python 3.11 (the official image's dependency set, as far as PyPI tells). tests/test_packaging.py
# installs the plugin against it and asserts that nothing but oomguard is added or changed.
# Needs PyPI; resolves metadata only (nothing is installed).
set -euo pipefail
cd "$(dirname "$0")/.."
report=$(mktemp)
trap 'rm -f "$report"' EXIT
python3 -m pip install --dry-run --ignore-installed --only-binary=:all: --quiet \
  --report "$report" vllm==0.33.0 2>&1 | sed -e "/^WARNING: Location 'file:/d"
{
  echo "# vLLM 0.33.0's resolved dependency set (Linux x86_64, Python 3.11), the stand-in for the"
  echo "# official image's environment. Regenerate with scripts/vllm-env.sh."
  python3 -c 'import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    meta = item["metadata"]
    print(meta["name"] + "==" + meta["version"])' "$report" | LC_ALL=C sort -f
} > requirements/vllm-0.33-env.txt
echo "wrote requirements/vllm-0.33-env.txt ($(grep -c '==' requirements/vllm-0.33-env.txt) packages)"
