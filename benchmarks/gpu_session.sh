#!/usr/bin/env bash
# The checks of one session on a lent GPU machine, as one prepared script: the CUDA tests, the numbers against plain
# Lightning (benchmarks/cuda_numerics.py) and the quick GPU benchmark. Writes every log under OUT.
#
#   bash benchmarks/gpu_session.sh OUT [TEST_SECONDS] [BENCH_SECONDS]
#
# Wheels under .whl/ (kvikio-cu13, libkvikio-cu13, rapids-logger for the GDS path) are installed to /tmp/site first.
set -u
out=${1:?usage: gpu_session.sh OUT [TEST_SECONDS] [BENCH_SECONDS]}
test_seconds=${2:-300}
bench_seconds=${3:-150}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
python3 setup.py build_ext --inplace > "$out/build.log" 2>&1 || echo "native kernel build failed: see build.log"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    nproc; free -g | head -2; df -h /tmp | tail -1
    python3 -c "import torch, lightning, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'lightning', lightning.__version__, 'transformers', transformers.__version__)"
    python3 -c "import kvikio; print('kvikio', kvikio.__version__)"
    python3 -c "import lightning_ratel._C; print('native kernel: built')"
} > "$out/env.txt" 2>&1
timeout "$test_seconds" python3 -m pytest -q -rA -p no:cacheprovider tests/test_cuda.py tests/test_gds.py \
    tests/test_flops.py --junitxml="$out/junit.xml" > "$out/test_cuda.log" 2>&1 &
tests=$!
timeout "$test_seconds" python3 -m benchmarks.cuda_numerics --out "$out" > "$out/cuda_numerics.log" 2>&1 &
numerics=$!
wait $tests; echo "tests rc=$?"
wait $numerics; echo "cuda_numerics rc=$?"
mkdir -p /tmp/ratel-bench
# Optimizer states in host memory (the default where they fit), then in the swap files (the disk-bound baseline).
for states in auto ssd; do
    mkdir -p "$out/states-$states"
    timeout "$bench_seconds" python3 -m benchmarks.gpu_throughput --quick --systems ratel --no-search \
        --ssd /tmp/ratel-bench --ratel-states "$states" --out "$out/states-$states" \
        --max-seconds $((bench_seconds - 20)) > "$out/gpu_throughput-$states.log" 2>&1
    echo "gpu_throughput ($states) rc=$?"
done
cat "$out/env.txt"
grep -E "passed|failed|error" "$out/test_cuda.log" | tail -3
grep -E "^(FAILED|ERROR)" "$out/test_cuda.log" | head -30
