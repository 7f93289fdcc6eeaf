#!/usr/bin/env bash
# The torch / Python matrix, run locally: for each leg a virtual environment with that torch and Python, the package
# installed from pyproject.toml as CI installs it, then the tests of every private torch name and of the main paths.
#
#   scripts/torch_matrix.sh                      # every leg below
#   scripts/torch_matrix.sh 2.15.0:3.12          # one leg: torch version, Python version
#   MATRIX_INSTALL_ONLY=1 scripts/torch_matrix.sh   # build the environments, run nothing
#   MATRIX_TESTS='tests/test_parity.py' scripts/torch_matrix.sh 2.14.1:3.11   # other tests
#
# The exit status is 1 when a leg failed (CI runs two legs with it: .ci/run).
#
# Environments go to $MATRIX_VENVS (default .matrix/, reused when present); the table is printed at the end and kept
# in $MATRIX_VENVS/table.md. A torch wheel is taken from the configured index first (this machine's disk), else
# from PyPI (a CUDA build: it runs on CPUs). The interpreter is pyenv's Python 3.X (~/.pyenv/versions), else
# `python3.X` from PATH.
# The legs run one after another (each test run uses every core).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VENVS=${MATRIX_VENVS:-$REPO/.matrix}
LEGS=("$@")
[ ${#LEGS[@]} -eq 0 ] && LEGS=(2.11.0:3.11 2.13.0:3.11 2.14.1:3.11 2.15.0:3.12 2.15.0:3.13)
# The tests of the private torch names (torch_compat, FSDP2's comm classes, compile), and the main paths: the
# initialisation rule, parity, checkpoints, tensor parallelism, weight averaging, Hugging Face loading and LoRA, and the
# same scripts under the standalone pytorch_lightning package.
TESTS=${MATRIX_TESTS:-tests/test_torch_compat.py tests/test_gloo_comms.py tests/test_shm_comms.py tests/test_compile.py
    tests/test_init_rule.py tests/test_direct_calls.py tests/test_fsdp1_compat.py tests/test_parity.py
    tests/test_checkpoints.py tests/test_tensor_parallel.py tests/test_averaging.py tests/test_hf_models.py
    tests/test_lora.py tests/test_lora_estimate.py tests/test_standalone.py tests/test_stream_jump.py
    tests/test_draw_counts.py tests/test_init_skip.py}
mkdir -p "$VENVS"

interpreter() {  # the newest python$1 that runs (a pyenv shim on PATH may not)
    local candidate
    for candidate in $(ls -d "$HOME"/.pyenv/versions/"$1".*/bin/python 2>/dev/null | sort -rV) $(command -v "python$1"); do
        "$candidate" -c "import sys" 2>/dev/null && { echo "$candidate"; return; }
    done
}

build() {  # torch python venv
    local torch=$1 python=$2 venv=$3 py
    [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import torch, lightning_shard" 2>/dev/null && return 0
    py=$(interpreter "$python")
    [ -n "$py" ] || { echo "no Python $python (PATH or pyenv)"; return 1; }
    rm -rf "$venv" && "$py" -m venv "$venv" || return 1
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet "torch==$torch" 2>/dev/null \
        || PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install --quiet "torch==$torch" || return 1
    # the other requirements from the same places; torch stays as installed (pyproject.toml has no upper bound): a
    # constraint pins it, replacing any the pip configuration sets (one here caps torch at the releases on disk)
    local pin="$venv/torch-pin.txt"
    echo "torch==$torch" > "$pin"
    PIP_CONSTRAINT=$pin "$venv/bin/python" -m pip install --quiet -e "$REPO[test,hf]" 2>/dev/null \
        || PIP_CONSTRAINT=$pin PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install --quiet -e "$REPO[test,hf]" \
        || return 1
    "$venv/bin/python" -m pip install --quiet --no-deps litgpt==0.5.13 \
        || PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install --quiet --no-deps litgpt==0.5.13
    "$venv/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$torch', torch.__version__"
}

ROWS=()
FAILED=0
for leg in "${LEGS[@]}"; do
    torch=${leg%%:*} python=${leg##*:}
    venv=$VENVS/torch$torch-py$python
    echo "== torch $torch, Python $python ($venv)"
    if ! build "$torch" "$python" "$venv" > "$venv.build.log" 2>&1; then
        ROWS+=("| $torch | $python | environment failed: see $venv.build.log | | |")
        FAILED=1
        continue
    fi
    [ -n "${MATRIX_INSTALL_ONLY:-}" ] && continue
    versions=$("$venv/bin/python" -c "import sys, torch, lightning, pytorch_lightning; print(f'{sys.version.split()[0]} / torch {torch.__version__} / lightning {lightning.__version__} / pytorch_lightning {pytorch_lightning.__version__}')")
    start=$(date +%s)
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider $TESTS > "$venv.tests.log" 2>&1
    status=$?
    [ $status -eq 0 ] || FAILED=1
    seconds=$(( $(date +%s) - start ))
    summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$venv.tests.log" | tail -1 | tr -d '=')
    ROWS+=("| $torch | $python | $versions | ${summary:-exit $status} | ${seconds} s |")
    echo "   ${summary:-exit $status} in ${seconds} s"
done

{
    echo "| torch | Python | versions | tests | time |"
    echo "|---|---|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
} | tee "$VENVS/table.md"
exit $FAILED
