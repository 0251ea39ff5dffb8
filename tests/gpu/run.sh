#!/usr/bin/env bash
# Run the GPU test suite, the GPU examples and the NCCL benchmark on a GPU machine; write a
# summary under $OUT.
#
#   bash tests/gpu/run.sh            # from the repository root; OUT unset -> a new temp dir
#
# Needs only python3 with torch, numpy, pytest and pytest-timeout, plus cupy with NCCL
# for the GPU parts: no Ray, no install (collective is imported from this checkout).
# Without a GPU every part says why it did not run, and the script still succeeds.
# The GPU examples are the programs in examples/ whose docstring has a line starting with
# "GPU example:"; each runs as a user runs it, and needs Ray (see GPU_WHEELS below):
# without Ray each is reported skipped, saying so.
# Writes to $OUT: summary.md (machine, pytest summary, each GPU example's outcome,
# benchmark tables), env.txt, pytest.log (the suite's output, then each example's),
# bench.log, bench.txt, bench.json, bench_check.txt (the 8-byte allreduce at world
# size 2 with the NCCL mismatch check on, beside the op and off) and profile.txt (what each CUDA call of our
# 8-byte allreduce costs alone, and where the call spends its time): eight files, so that a tool that copies back at most
# eight brings them all. Exits non-zero if a test, a GPU example or the benchmark failed.
# Time limits (seconds), each overridable: GPU_TESTS_TIMEOUT_S, EXAMPLE_TIMEOUT_S (each
# example), BENCH_TIMEOUT_S and BENCH_BUDGET_S (the benchmark stops measuring new points
# after it), SHARED_BENCH_TIMEOUT_S (the benchmark of ranks that share a GPU).
# World sizes 2 and 3 run on any GPU machine: where fewer GPUs are visible than ranks,
# the rank processes share them, each claiming a host of its own for NCCL
# (NCCL_HOSTID, NCCL_SOCKET_IFNAME=lo; see tests/gpu/cases.py).
# RUN_PARTS (default "tests examples bench") picks the parts to run, so that a machine lent
# for less than the whole run can take them in separate calls; GPU_TESTS (default
# tests/gpu) the test paths (and any pytest arguments) of the "tests" part. Without
# GPU_TESTS, the GPU review's tests (tests/gpu/test_review*.py) run first, on their own
# (limit GPU_REVIEW_TIMEOUT_S), so that a short run settles them.
# GPU_WHEELS=DIR installs the wheels in DIR (e.g. Ray and its dependencies, for a
# machine without network) with pip install --no-index --no-deps --target, so that the
# Ray GPU tests run; without Ray they skip, saying so.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

if [ -n "${GPU_WHEELS:-}" ]; then
    # Installed outside $OUT: everything under $OUT is meant to be copied back.
    site="$(mktemp -d)"
    "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$site" \
        "$GPU_WHEELS"/*.whl >"$site.log" 2>&1 || { echo "GPU_WHEELS: install failed:"; tail -n 20 "$site.log"; }
    export PYTHONPATH="$PYTHONPATH:$site"
    export PATH="$site/bin:$PATH"
fi

# cupy loads libnccl.so.2 at import; point the loader at the NCCL of the nvidia-nccl wheel.
nccl_lib="$("$PYTHON" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)"
if [ -n "$nccl_lib" ] && [ -d "$nccl_lib" ]; then
    export LD_LIBRARY_PATH="$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(uname -a)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
    else
        echo "nvidia-smi: not found"
    fi
    "$PYTHON" - <<'EOF'
import importlib, platform
print(f"python: {platform.python_version()}")
for name in ("numpy", "torch", "cupy", "pytest", "ray"):
    try:
        print(f"{name}: {importlib.import_module(name).__version__}")
    except Exception as exc:
        print(f"{name}: not importable ({type(exc).__name__}: {exc})")
try:
    import torch
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else "-"
    print(f"torch cuda: {torch.version.cuda}, gpus: {torch.cuda.device_count()}, nccl: {nccl}")
except Exception as exc:
    print(f"torch cuda: {type(exc).__name__}: {exc}")
from collective.groups.nccl.comm import unavailable_reason
print(f"collective nccl backend: {unavailable_reason() or 'available'}")
EOF
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

RUN_PARTS="${RUN_PARTS:-tests examples bench}"
runs() { case " $RUN_PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

tests_rc=0
if runs tests; then
    review_rc=0
    if [ -z "${GPU_TESTS:-}" ]; then
        timeout -k 10 "${GPU_REVIEW_TIMEOUT_S:-600}" "$PYTHON" -m pytest -p no:cacheprovider \
            --confcutdir=tests/gpu -v -ra --timeout=120 tests/gpu/test_review*.py 2>&1 | tee "$OUT/pytest.log"
        review_rc=${PIPESTATUS[0]}
    fi
    # shellcheck disable=SC2086  # GPU_TESTS holds paths and pytest arguments
    timeout -k 10 "${GPU_TESTS_TIMEOUT_S:-900}" "$PYTHON" -m pytest -p no:cacheprovider \
        --confcutdir=tests/gpu -v -ra --timeout=120 ${GPU_TESTS:-tests/gpu --ignore-glob=*/test_review*.py} 2>&1 | tee -a "$OUT/pytest.log"
    tests_rc=${PIPESTATUS[0]}
    [ "$tests_rc" -eq 0 ] && tests_rc=$review_rc
else
    echo "tests: not run (RUN_PARTS=$RUN_PARTS)" | tee "$OUT/pytest.log"
fi
pytest_lines=$(wc -l <"$OUT/pytest.log")

# Every GPU example, found by its docstring's marker line. Its output follows the suite's in
# pytest.log (no file of its own: see the file count above); its outcome goes to summary.md.
examples_rc=0
example_outcomes="$(mktemp)"
example_out="$(mktemp)"
if "$PYTHON" -c "import ray" >/dev/null 2>&1; then
    no_ray=""
else
    no_ray="Ray is not importable (GPU_WHEELS=DIR installs it)"
fi
runs examples || no_ray="not run (RUN_PARTS=$RUN_PARTS)"
for example in $(grep -l '^GPU example:' examples/*.py); do
    if [ -n "$no_ray" ]; then
        outcome="skipped: $no_ray"
        echo "===== $example: $outcome" | tee -a "$OUT/pytest.log"
    else
        echo "===== $example" | tee -a "$OUT/pytest.log"
        timeout -k 10 "${EXAMPLE_TIMEOUT_S:-360}" "$PYTHON" "$example" >"$example_out" 2>&1
        rc=$?
        tee -a "$OUT/pytest.log" <"$example_out"
        skipped="$(grep -m 1 '^skipped: ' "$example_out")"
        if [ "$rc" -eq 0 ] && [ -n "$skipped" ]; then
            outcome="$skipped"
        elif [ "$rc" -eq 0 ]; then
            outcome="passed"
        elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
            outcome="failed: timed out after ${EXAMPLE_TIMEOUT_S:-360} s"
        else
            outcome="failed: exit status $rc (its output is in pytest.log)"
        fi
        case "$outcome" in failed*) examples_rc=1 ;; esac
    fi
    echo "$example: $outcome" >>"$example_outcomes"
done
[ -s "$example_outcomes" ] || echo "no example has a line starting with 'GPU example:'" >"$example_outcomes"

bench_rc=0
if runs bench; then
    timeout -k 10 "${BENCH_TIMEOUT_S:-400}" "$PYTHON" -m benchmarks.nccl \
        --budget-s "${BENCH_BUDGET_S:-300}" --json "$OUT/bench.json" --text "$OUT/bench.txt" \
        --profile "$OUT/profile.txt" 2>&1 | tee "$OUT/bench.log"
    bench_rc=${PIPESTATUS[0]}

    # Ranks that share one GPU: the shared-GPU transport beside the copy bound and NCCL over
    # sockets; its table is appended to bench.txt and its results merged into bench.json.
    timeout -k 10 "${SHARED_BENCH_TIMEOUT_S:-360}" "$PYTHON" -m benchmarks.nccl --shared-gpu \
        --json "$OUT/bench.json" --text "$OUT/bench.txt" >>"$OUT/bench.log" 2>&1
    shared_rc=$?
    [ "$shared_rc" -eq 0 ] || { echo "shared-GPU benchmark: exit $shared_rc (see bench.log)"; bench_rc=$shared_rc; }
    # Where NCCL 2.30+ was measured beside it: the routes table to review and commit as
    # collective/groups/gpu/multirank_routes.json (the command says why where it cannot).
    "$PYTHON" -m benchmarks.multirank_routes --from "$OUT/bench.json" \
        --to "$OUT/multirank_routes.json" >>"$OUT/bench.log" 2>&1 || true

    # The NCCL mismatch check's cost at world size 2 (a group of one skips it): on the op's
    # stream, beside it (which relies on NCCL_LAUNCH_ORDER_IMPLICIT=1) and off, in one run.
    NCCL_LAUNCH_ORDER_IMPLICIT=1 timeout -k 10 150 "$PYTHON" -m benchmarks.nccl --ops allreduce \
        --sizes 8 --world-sizes 2 --budget-s 100 \
        --impls collective,collective_sidecheck,collective_nocheck,cupy_nccl \
        --text "$OUT/bench_check.txt" >>"$OUT/bench.log" 2>&1
else
    echo "benchmark: not run (RUN_PARTS=$RUN_PARTS)" >"$OUT/bench.log"
fi

{
    echo "# GPU suite, GPU examples and NCCL benchmark"
    echo
    echo '```text'
    cat "$OUT/env.txt"
    echo '```'
    echo
    echo "## pytest tests/gpu (exit $tests_rc)"
    echo
    echo '```text'
    if head -n "$pytest_lines" "$OUT/pytest.log" | grep -q "short test summary info"; then
        head -n "$pytest_lines" "$OUT/pytest.log" | sed -n '/short test summary info/,$p'
    else
        head -n "$pytest_lines" "$OUT/pytest.log" | tail -n 40
    fi
    echo '```'
    echo
    echo "To record where each GPU feature ran: python -m benchmarks.gpu_results --tests"
    echo "pytest.log --env env.txt (docs/gpu-status.md; commit it and docs/performance/gpu-runs.json)."
    echo
    echo "## GPU examples (exit $examples_rc)"
    echo
    echo '```text'
    cat "$example_outcomes"
    echo '```'
    echo
    echo "## python -m benchmarks.nccl (exit $bench_rc)"
    echo
    echo "To publish it: python -m benchmarks.gpu_results --from bench.json (checks the run,"
    echo "writes docs/performance/gpu.json and the README's GPU block; commit both)."
    echo
    echo '```text'
    if [ -s "$OUT/bench.txt" ]; then cat "$OUT/bench.txt"; else tail -n 40 "$OUT/bench.log"; fi
    echo '```'
    echo
    echo "## what each call of our 8-byte allreduce costs alone (from profile.txt)"
    echo
    echo '```text'
    if [ -s "$OUT/profile.txt" ]; then sed -n '1,/^$/p' "$OUT/profile.txt"; else echo "no profile"; fi
    echo '```'
    echo
    echo "## the mismatch check's cost: 8-byte allreduce, world size 2, check on, beside, off"
    echo
    echo '```text'
    if [ -s "$OUT/bench_check.txt" ]; then cat "$OUT/bench_check.txt"; else tail -n 20 "$OUT/bench.log"; fi
    echo '```'
} >"$OUT/summary.md"
rm -f "$example_outcomes" "$example_out"
echo "summary: $OUT/summary.md"

# pytest exits 5 when it collected nothing: not a failure of the suite.
[ "$tests_rc" -eq 0 ] || [ "$tests_rc" -eq 5 ] || exit "$tests_rc"
[ "$examples_rc" -eq 0 ] || exit "$examples_rc"
exit "$bench_rc"
