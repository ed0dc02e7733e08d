#!/usr/bin/env bash
# The GPU checks of bench/README.md ("A GPU session") in one command, for a machine with a CUDA GPU and no network:
#
#   bash bench/gpu_check.sh OUTDIR [PART]        PART: tests | tune | lora | step | pref | all (default all)
#
# Every part first installs what it needs (again each call: a fresh machine has nothing): the wheels in $GPU_CHECK_WHEELS
# (default .whl/ in the checkout; see bench/README.md for which) with pip --no-index --no-deps into a folder put on
# PYTHONPATH, and this checkout with pip install --no-deps -e; then it checks that torch sees a GPU and that the
# packages the part needs import. Each part fits one 10-minute call of the device tool; "all" runs them in turn.
#
#   tests  the CUDA-only tests (pytest -m cuda), then the kernel tests compiled (TRITON_INTERPRET=0)
#   tune   FASTFT_GEMM=auto over every LoRA group of the Llama-3.2-1B shape, bf16 and NF4, forward + backward:
#          fills the tuning cache in OUTDIR/cache and writes every choice to OUTDIR/tuner.json
#   lora   bench/lora.py: cublas / triton / auto / peft / bare GEMMs per group; OUTDIR/lora-<gpu>.json
#   step   fastft bench, one whole LoRA training step of the Llama-3.2-1B shape per system; OUTDIR/bench-<gpu>.json
#   pref   bench/preference.py: one DPO and one GRPO step of trl's trainers on the embedded SmolLM2-135M, fastft
#          ("offload" and "sqrt") against stock with and without checkpointing, device memory included;
#          OUTDIR/preference-<gpu>.json
#
# Every log and JSON goes to OUTDIR; the time each part took is printed at the end (and kept in gpu_check.log).
# Python always runs from a scratch folder outside the checkout: from the checkout's root, kernels/ would shadow the
# PyPI package `kernels` that bitsandbytes imports (README.md, "Layout").
#
# Environment: GPU_CHECK_WHEELS (wheel folder), PYTHON (default python3), GPU_CHECK_SITE (where the wheels are
# installed), GPU_TESTS (kernel test files, relative to tests/), GPU_CHECK_XDIST (pytest-xdist workers for those,
# default 4, 0: none), LORA_ARGS (extra bench/lora.py arguments, e.g. "--shapes llama-3.2-1b"), STEP_WORKLOADS and
# STEP_SYSTEMS (fastft bench --workloads / --systems). --dry-run prints the commands without running anything.

set -euo pipefail

PARTS=(tests tune lora step pref)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
    cat >&2 <<'EOF'
usage: bash bench/gpu_check.sh [--dry-run] OUTDIR [PART]
  OUTDIR  an existing folder for logs and JSON (on the device tool: "$OUT")
  PART    tests | tune | lora | step | pref | all (default: all); each part fits one 10-minute call
EOF
}

die() {
    echo "gpu_check: $*" >&2
    exit 2
}

DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
POSITIONAL=()
for arg in "$@"; do
    case $arg in
        --dry-run) DRY_RUN=1 ;;
        -h | --help)
            usage
            exit 0
            ;;
        -*) usage; die "unknown option '$arg'" ;;
        *) POSITIONAL+=("$arg") ;;
    esac
done
if [ ${#POSITIONAL[@]} -lt 1 ] || [ ${#POSITIONAL[@]} -gt 2 ]; then
    usage
    die "expected OUTDIR and at most one PART, got ${#POSITIONAL[@]} argument(s)"
fi
OUTDIR=${POSITIONAL[0]}
PART=${POSITIONAL[1]:-all}
[ -n "$OUTDIR" ] || die "OUTDIR is empty (on the device tool pass \"\$OUT\"; is it set?)"
for part in "${PARTS[@]}" all; do
    # `bash bench/gpu_check.sh $OUT tests` with OUT unset would take the part for the folder.
    [ "$OUTDIR" != "$part" ] || die "OUTDIR '$OUTDIR' is a part name: give the folder first (is \$OUT set?)"
done
[ -d "$OUTDIR" ] || die "OUTDIR '$OUTDIR' is not a directory; create it first"
known=0
for part in "${PARTS[@]}" all; do
    if [ "$PART" = "$part" ]; then known=1; fi
done
if [ "$known" != 1 ]; then
    usage
    die "unknown PART '$PART'; choose one of: ${PARTS[*]} all"
fi
OUTDIR=$(cd "$OUTDIR" && pwd)

PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.whl}
SITE=${GPU_CHECK_SITE:-/tmp/fastft-gpu-check-site}
GPU_TESTS=${GPU_TESTS:-"test_kernel_*.py test_fused_lora_model.py"}
XDIST=${GPU_CHECK_XDIST:-4}
LORA_ARGS=${LORA_ARGS:-}
STEP_WORKLOADS=${STEP_WORKLOADS:-llama-3.2-1b-bf16-4x2048}
STEP_SYSTEMS=${STEP_SYSTEMS:-transformers+peft transformers+peft+gc fastft fastft+offload}
# Compiled kernels, never the interpreter (tests/conftest.py turns it on unless told otherwise).
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/fastft-gpu-check.XXXXXX")

CURRENT=setup
FAILED=0
TIMES=()

log() {
    echo "gpu_check: $*"
    if [ "$DRY_RUN" != 1 ]; then echo "gpu_check: $*" >>"$OUTDIR/gpu_check.log"; fi
}

# fail STATUS WHAT: say which part failed, at what, and where its output is; then stop with STATUS.
fail() {
    local status=$1
    shift
    FAILED=1
    echo "gpu_check: part '$CURRENT' FAILED (exit $status): $*" >&2
    echo "gpu_check: its output is in $OUTDIR/$CURRENT.log" >&2
    if [ "$DRY_RUN" != 1 ]; then echo "gpu_check: part '$CURRENT' FAILED (exit $status): $*" >>"$OUTDIR/gpu_check.log"; fi
    exit "$status"
}

finish() {
    local status=$?
    for line in ${TIMES[@]+"${TIMES[@]}"}; do log "$line"; done
    rm -rf "$SCRATCH"
    if [ "$status" -eq 0 ]; then
        log "done: $PART (files in $OUTDIR)"
    elif [ "$FAILED" = 0 ]; then
        # set -e stopped the script outside run/fail: still say where.
        echo "gpu_check: part '$CURRENT' FAILED (exit $status)" >&2
    fi
}
trap finish EXIT

# run DIR CMD...: CMD in DIR, its output shown and appended to OUTDIR/<part>.log; --dry-run only prints it.
run() {
    local dir=$1 status
    shift
    if [ "$DRY_RUN" = 1 ]; then
        echo "+ (cd $dir) $*"
        return 0
    fi
    echo "+ (cd $dir) $*" >>"$OUTDIR/$CURRENT.log"
    set +e
    (cd "$dir" && "$@") 2>&1 | tee -a "$OUTDIR/$CURRENT.log"
    status=${PIPESTATUS[0]}
    set -e
    [ "$status" -eq 0 ] || fail "$status" "$*"
}

# expect FILE...: the part must have written these (skipped in a dry run).
expect() {
    [ "$DRY_RUN" = 1 ] && return 0
    local file
    for file in "$@"; do
        [ -e "$file" ] || fail 1 "it wrote no $file"
    done
}

# What each part imports beyond torch and fastft; a missing one stops the part before it starts.
needs() {
    case $1 in
        tests) echo "triton transformers peft accelerate bitsandbytes trl datasets gguf" ;;
        tune) echo "triton bitsandbytes" ;;
        lora) echo "triton peft bitsandbytes transformers" ;;
        step) echo "triton transformers peft accelerate bitsandbytes" ;;
        pref) echo "triton transformers peft accelerate trl datasets gguf" ;;
    esac
}

# Before a part starts: a missing wheel, a fastft from elsewhere or no GPU fails in seconds, by name.
PREFLIGHT='import importlib, os, sys
root, required = sys.argv[1], sys.argv[2].split()
optional = ["triton", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "datasets", "gguf"]
missing = []
for name in ["torch", "fastft", *dict.fromkeys(required + optional)]:
    try:
        module = importlib.import_module(name)
    except Exception as error:
        print(f"  {name}: cannot import ({type(error).__name__}: {error})")
        if name in required or name in ("torch", "fastft"):
            missing.append(name)
        continue
    version, where = getattr(module, "__version__", "?"), os.path.dirname(module.__file__ or "?")
    print(f"  {name} {version} from {where}")
if missing:
    sys.exit(f"missing: {missing}; carry their wheels in .whl/ (bench/README.md, A GPU session)")
import fastft, torch
if not os.path.realpath(fastft.__file__).startswith(os.path.realpath(root) + os.sep):
    sys.exit(f"fastft is imported from {fastft.__file__}, not from this checkout {root}")
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device: these checks need a GPU")
print(f"  {torch.cuda.get_device_name(0)}, compute capability {torch.cuda.get_device_capability(0)}, "
      f"CUDA {torch.version.cuda}")
'

setup() {
    CURRENT=setup
    local begin=$SECONDS
    log "setup for '$PART' (checkout $ROOT, output $OUTDIR)"
    shopt -s nullglob
    local wheels=("$WHEELS"/*.whl)
    shopt -u nullglob
    if [ ${#wheels[@]} -gt 0 ]; then
        run "$SCRATCH" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "${wheels[@]}"
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    else
        log "no wheels in $WHEELS: bitsandbytes, trl, datasets, gguf must already be installed"
    fi
    # No build isolation: it would fetch setuptools from an index the machine cannot reach.
    run "$SCRATCH" "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
    local required
    required=$(if [ "$PART" = all ]; then for p in "${PARTS[@]}"; do needs "$p"; done; else needs "$PART"; fi)
    printf '%s' "$PREFLIGHT" >"$SCRATCH/preflight.py"
    run "$SCRATCH" "$PY" "$SCRATCH/preflight.py" "$ROOT" "$(echo "$required" | tr '\n' ' ' | sed 's/ *$//')"
    if [ "$DRY_RUN" != 1 ] && command -v nvidia-smi >/dev/null; then
        run "$SCRATCH" nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    fi
    TIMES+=("setup took $((SECONDS - begin)) s")
}

part_tests() {
    local files=()
    # Only the files that hold CUDA-marked tests: collecting the whole suite would import packages (notebook
    # runners, the version lanes' tools) that this machine need not have.
    local file
    for file in "$ROOT"/tests/test_*.py; do
        if grep -q "pytest.mark.cuda" "$file"; then files+=("$(basename "$file")"); fi
    done
    [ ${#files[@]} -gt 0 ] || fail 1 "no test file in tests/ is marked cuda"
    run "$ROOT/tests" "$PY" -m pytest -q -p no:cacheprovider -m cuda "${files[@]}"
    local parallel=()
    if [ "$XDIST" != 0 ] && { [ "$DRY_RUN" = 1 ] || "$PY" -c "import xdist" 2>/dev/null; }; then
        # Compiling the Triton kernels is CPU work, and the tests are small: a few workers share the one GPU.
        parallel=(-n "$XDIST")
    fi
    # shellcheck disable=SC2086  # GPU_TESTS is a list of globs, expanded in tests/
    run "$ROOT/tests" "$PY" -m pytest -q -p no:cacheprovider ${parallel[@]+"${parallel[@]}"} $(cd "$ROOT/tests" && echo $GPU_TESTS)
}

part_tune() {
    run "$SCRATCH" env FASTFT_GEMM=auto FASTFT_CACHE_DIR="$OUTDIR/cache" \
        "$PY" "$ROOT/bench/lora.py" --tune-only --device cuda --shapes llama-3.2-1b --dtypes bf16 nf4 \
        --groups qkv o mlp --out "$OUTDIR/tuner.json"
    expect "$OUTDIR/tuner.json"
}

part_lora() {
    # shellcheck disable=SC2086  # LORA_ARGS is a list of arguments
    run "$SCRATCH" env FASTFT_CACHE_DIR="$OUTDIR/cache" \
        "$PY" "$ROOT/bench/lora.py" --device cuda --out-dir "$OUTDIR" $LORA_ARGS
    if [ "$DRY_RUN" != 1 ]; then
        compgen -G "$OUTDIR/lora-*.json" >/dev/null || fail 1 "bench/lora.py wrote no $OUTDIR/lora-*.json"
    fi
}

part_step() {
    # The table section goes to OUTDIR, not into the checkout's bench/README.md (the lead redraws that from the JSON
    # with fastft bench --readme-from). One measurement past 4 minutes is a failed row, not a lost call.
    # shellcheck disable=SC2086  # STEP_WORKLOADS and STEP_SYSTEMS are lists of names
    run "$SCRATCH" env FASTFT_CACHE_DIR="$OUTDIR/cache" \
        "$PY" "$ROOT/bench/run.py" --device cuda --workloads $STEP_WORKLOADS --systems $STEP_SYSTEMS \
        --rounds 2 --timeout 240 --output-dir "$OUTDIR" --readme "$OUTDIR/bench-readme-section.md"
    if [ "$DRY_RUN" != 1 ]; then
        compgen -G "$OUTDIR/bench-*.json" >/dev/null || fail 1 "fastft bench wrote no $OUTDIR/bench-*.json"
    fi
}

part_pref() {
    run "$SCRATCH" "$PY" "$ROOT/bench/preference.py" --device cuda --out "$OUTDIR/preference-cuda.json"
    expect "$OUTDIR/preference-cuda.json"
}

setup
if [ "$PART" = all ]; then selected=("${PARTS[@]}"); else selected=("$PART"); fi
for part in "${selected[@]}"; do
    CURRENT=$part
    begin=$SECONDS
    log "part '$part'"
    "part_$part"
    TIMES+=("part '$part' took $((SECONDS - begin)) s")
    log "part '$part' done in $((SECONDS - begin)) s"
done
