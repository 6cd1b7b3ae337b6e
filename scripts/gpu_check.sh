#!/usr/bin/env bash
# The GPU check: on one CUDA GPU, in under 8 minutes, with the torch and Triton the machine already has.
#
#   scripts/gpu_check.sh OUTDIR
#
# 1. ropelib's own report (python -m ropelib --check): which ways of running the rotation work;
# 2. the test suite natively on CUDA (Triton compiled, not interpreted);
# 3. every notebook through nbmake on the GPU (the chapters pick larger problems there);
# 4. python -m ropelib.bench at the GPU target shapes in bfloat16, forward and forward+backward,
#    with the decode-shape and model-step rows, liger-kernel and torch.compile as peers;
# 5. python -m ropelib.bench --kv-write: the rotation fused with the paged KV-cache write (Triton)
#    against rotary_qk + index_copy_, at the GPU decode and prefill shapes, float32 and bfloat16;
# 6. python -m ropelib.lab --large, with whatever time is left of the 8 minutes;
# 7. python -m ropelib.lab --text --large (the lab on real text), if time is left (raise GPU_CHECK_SECONDS).
# It writes JSON records with provenance (device, versions, date, command, each step's status and
# seconds) into OUTDIR. A step that fails is recorded and the next one still runs.
#
# Packages the machine lacks (the Jupyter stack, liger-kernel, rotary-embedding-torch) travel as
# wheels in .whl/ (scripts/fetch_gpu_wheels.sh fetches them, see scripts/README.md); ropelib itself
# is used from this checkout, installed with --no-deps, so the machine's own torch stays.
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
root=$(pwd)
start=$SECONDS
budget=${GPU_CHECK_SECONDS:-480}
stamp=$(date -u +%Y-%m-%d)
if [[ -d .whl ]] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    { echo "could not install the carried wheels" >&2; exit 1; }
  export PYTHONPATH="/tmp/site:$root"
  export PATH="/tmp/site/bin:$PATH"
else
  export PYTHONPATH="$root"
fi
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 MPLBACKEND=Agg
# GPU_CHECK_SMOKE=1 runs every step small on any machine, to check this script itself (not a GPU record).
smoke=${GPU_CHECK_SMOKE:-0}
if [[ $smoke != 1 ]]; then
  python3 -c "import torch; assert torch.cuda.is_available()" ||
    { echo "no CUDA device: this script is for a GPU machine (GPU_CHECK_SMOKE=1 to try it anyway)" >&2; exit 1; }
  tests=(tests) notebooks=(book) bench=(--shapes 1,8192,32,8,128 4,4096,32,8,128 --dtypes bfloat16) lab=(--large)
  kv_bench=(--kv-shapes decode:256,32,8,128,16 prefill:16384,32,8,128,16 --dtypes float32 bfloat16)
else
  tests=(tests/test_main.py) notebooks=(book/why_position.ipynb) bench=(--quick --no-compile) lab=(--quick)
  kv_bench=(--quick)
  unset TRITON_INTERPRET  # no GPU: let the Triton kernel run in the interpreter
fi

steps_json="$out/.steps"
: >"$steps_json"
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to OUTDIR/NAME.log, record status and time
  local name=$1 limit=$2
  shift 2
  local left=$((budget - (SECONDS - start)))
  ((limit > left)) && limit=$left
  if ((limit < 20)); then
    echo "{\"step\": \"$name\", \"status\": \"skipped (no time left)\", \"seconds\": 0}" >>"$steps_json"
    return
  fi
  local t0=$SECONDS
  echo "== $name (at most $limit s)"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 5 "$out/$name.log"
  echo "{\"step\": \"$name\", \"status\": $rc, \"seconds\": $((SECONDS - t0)), \"command\": \"$*\"}" >>"$steps_json"
}

step ropelib_check 60 python3 -m ropelib --check
step tests 200 python3 -m pytest "${tests[@]}" -q -p no:cacheprovider --junitxml="$out/tests.xml"
step notebooks 150 python3 -m pytest --nbmake "${notebooks[@]}" -q -p no:cacheprovider
step bench 150 python3 -m ropelib.bench "${bench[@]}" --quiet --json "$out/bench_gpu_$stamp.json"
step bench_kv_write 60 python3 -m ropelib.bench --kv-write "${kv_bench[@]}" --quiet --json "$out/bench_kv_write_gpu_$stamp.json"
step lab 360 python3 -m ropelib.lab "${lab[@]}" --json "$out/lab_gpu_$stamp.json"
lab_text=(--large)
[[ $smoke == 1 ]] && lab_text=(--quick)
step lab_text 600 python3 -m ropelib.lab --text "${lab_text[@]}" --quiet --json "$out/lab_text_gpu_$stamp.json"

python3 - "$out" "$steps_json" "$stamp" <<'PY'
import datetime, json, platform, sys
import torch
out, steps, stamp = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = None
record = {
    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (smoke run)",
    "torch": torch.__version__,
    "triton": triton_version,
    "cuda": torch.version.cuda,
    "python": platform.python_version(),
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "command": "scripts/gpu_check.sh OUTDIR",
    "steps": [json.loads(line) for line in open(steps, encoding="utf-8") if line.strip()],
}
with open(f"{out}/gpu_check_{stamp}.json", "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1)
print(json.dumps(record["steps"], indent=1))
PY
rm -f "$steps_json"
echo "gpu_check finished in $((SECONDS - start)) s; records in $out"
