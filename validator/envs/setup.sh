#!/usr/bin/env bash
# Create (or reuse) the virtual environment one external engine runs in.
#   validator/envs/setup.sh tl|nnsight|nnterp|interp|saelens|circuit_tracer [--force]
# IE_LAB_VALIDATOR_TRANSFORMERS=X.Y.Z installs that transformers instead of the pinned one (the newest-transformers
# sweep: use it with its own IE_LAB_VALIDATOR_VENVS folder, so the pinned environments stay as they are).
# The environment lands in $IE_LAB_VALIDATOR_VENVS/NAME (default: .venvs/NAME at the repository root) and is
# rebuilt only when validator/envs/NAME.txt changed (its hash is stamped inside the venv). Installs come from
# PyPI only; torch is the CPU build CI already uses (the pip cache or a local wheel makes it quick).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
name="${1:?usage: setup.sh tl|nnsight|nnterp|interp|saelens|circuit_tracer [--force]}"
reqs="$here/$name.txt"
[ -f "$reqs" ] || { echo "no requirements file $reqs" >&2; exit 2; }
venvs="${IE_LAB_VALIDATOR_VENVS:-$root/.venvs}"
dir="$venvs/$name"
tf="${IE_LAB_VALIDATOR_TRANSFORMERS:-}"
want="$( { cat "$reqs"; [ -z "$tf" ] || echo "transformers override $tf"; } | sha256sum | cut -c1-16)"
if [ "${2:-}" != "--force" ] && [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.validator-stamp" 2>/dev/null)" = "$want" ]; then
  echo "$dir is up to date"
  exit 0
fi
rm -rf "$dir"
mkdir -p "$venvs"
python3 -m venv "$dir"
"$dir/bin/python" -m pip install -q --upgrade pip
# torch first and pinned, as ./dev does: an unpinned torch would pull a multi-GB CUDA build on CPU machines.
"$dir/bin/python" -m pip install -q "torch==2.13.0"
if [ -n "$tf" ]; then
  "$dir/bin/python" -m pip install -q -r <(sed "s/^transformers==.*/transformers==$tf/" "$reqs")
else
  "$dir/bin/python" -m pip install -q -r "$reqs"
fi
echo "$want" > "$dir/.validator-stamp"
"$dir/bin/python" -m pip freeze > "$dir/.validator-freeze.txt"
echo "built $dir"
