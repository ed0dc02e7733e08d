#!/usr/bin/env bash
# Issue 28's like-for-like table in one short device call: fastft against Unsloth in each checkpointing mode both
# have, transformers + peft as the baseline, and fastft with regional compilation (get_peft_model(compile=True)).
#
#   bash bench/gpu_modes.sh OUTDIR          (on the device tool: carry .whl, built by bench/offline_wheels.py)
#
# Each group is its own `fastft bench` run and JSON (OUTDIR/<group>/bench-<gpu>.json), in priority order, so a call
# cut short still returns every group it finished; each group holds its Unsloth rival, so each ratio is one run's.
# Unsloth's processes take about 100 s each (import, its own compile), fastft's about 30 s, a compiled fastft one
# about a minute more: the four Llama groups take about six minutes with the set-up; GPU_MODES_GROUPS picks groups
# (none recompute offload compile vlm trace compile-traced), vlm being issue 33's vision-language workload, trace the
# timelines of fastft's and Unsloth's profiled steps (bench/gpu_gaps.py) and compile-traced fastft compiled over the
# kernels' torch reference; the last two run only when named.
set -uo pipefail
OUTDIR=$(cd "${1:?usage: bash bench/gpu_modes.sh OUTDIR}" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
SITE=/tmp/fastft-gpu-site
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$ROOT/.whl $ROOT/.whl/competitors" PIP_DISABLE_PIP_VERSION_CHECK=1
begin=$SECONDS
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$ROOT"/.whl/*.whl \
    || exit 2
export PYTHONPATH=$SITE
"$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" || exit 2
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUTDIR/gpu.txt"
echo "set-up: $((SECONDS - begin)) s" | tee -a "$OUTDIR/gpu.txt"
# Python runs outside the checkout: its kernels/ would shadow the PyPI package `kernels` bitsandbytes imports.
cd "$(mktemp -d)" || exit 2
# The first group that runs also builds Unsloth's venv and writes the random-weight model (about 40 s on a fresh
# machine), so it gets that much more time than its box.
first_extra=60
group() {
    local name=$1 box=$2 workload=llama-3.2-1b-bf16-4x2048
    shift 2
    if [ "$name" = vlm ]; then workload=qwen2.5-vl-7b-bf16-4x1280; fi
    case " ${GPU_MODES_GROUPS:-none recompute offload compile vlm} " in *" $name "*) ;; *) return 0 ;; esac
    mkdir -p "$OUTDIR/$name"
    local start=$SECONDS
    timeout -k 10 "$((box + first_extra))" "$PY" "$ROOT/bench/run.py" --device cuda --workloads "$workload" --rounds 1 \
        --steps 5 --timeout 170 --systems "$@" --output-dir "$OUTDIR/$name" --readme "$OUTDIR/$name/table.md" \
        >"$OUTDIR/$name/log.txt" 2>&1
    echo "group $name: exit $? in $((SECONDS - start)) s" | tee -a "$OUTDIR/gpu.txt"
    first_extra=0
    tail -n 25 "$OUTDIR/$name/log.txt"
}
group none 260 transformers+peft unsloth-nogc fastft
group recompute 170 unsloth-gc fastft+recompute
group offload 170 unsloth fastft+offload
group compile 200 fastft+compile fastft+offload+compile
# Where the GPU still waits: Unsloth and fastft with and without recompute, each profiled step's timeline kept
# (OUTDIR/trace/timelines/<system>.json.gz; `python bench/gpu_gaps.py` reads them). Not in the default list.
FASTFT_BENCH_TRACE_DIR="$OUTDIR/trace/timelines" group trace 260 fastft fastft+recompute unsloth-nogc
# Compiled with the kernels' torch reference (FASTFT_DISABLE_TRITON=1): the compiler traces fastft's layer as plain
# torch and makes its own kernels around cuBLAS, as Unsloth's compiled regions do (kernels/traced_reference.py).
# Unsloth beside it for the ratio (eager fastft: the none group). Not in the default list.
FASTFT_DISABLE_TRITON=1 group compile-traced 260 fastft+compile unsloth-nogc
# Issue 33's Qwen2.5-VL-7B workload (8.3e9 parameters, one image per example): stock, Unsloth, fastft.
group vlm 300 transformers+peft unsloth-nogc fastft
touch "$OUTDIR/done"
