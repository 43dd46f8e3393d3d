#!/usr/bin/env bash
# Style check run by CI before the tests: ruff (lint + isort, config in pyproject.toml) over the Python and
# clang-format (.clang-format) over the C++, then the Markdown's relative links (tools/check_links.py). Fails with
# the one command that fixes what can be fixed mechanically.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

mapfile -t cpp < <(git ls-files 'csrc/*.cpp' 'csrc/*.h' 'bench/device/*.cpp' 'bench/device/*.h')
fix="ruff check --fix . && clang-format -i \$(git ls-files 'csrc/*.cpp' 'csrc/*.h' 'bench/device/*.cpp' 'bench/device/*.h')"

status=0
echo "ruff $(ruff --version | cut -d' ' -f2): ruff check ."
ruff check . || status=1
echo "clang-format $(clang-format --version | grep -o '[0-9][0-9.]*' | head -1): ${#cpp[@]} C++ files"
clang-format --dry-run --Werror "${cpp[@]}" || status=1
python3 tools/check_links.py || status=1

if [ "$status" -ne 0 ]; then
  echo "style check failed; to fix (then wrap what ruff cannot): cd $(pwd) && $fix" >&2
  exit 1
fi
echo "style ok"
