#!/usr/bin/env bash
# Concurrency and compile on a GPU in one device call: cuBLAS under CUDA-graph capture
# (tools/swiglu_graph_race.py: wrong outputs of graphs replayed at once, plain F.linear beside
# tilefuse's paths), `tilefuse stress --quick` (every family and variant on two streams, two
# threads and two graphs), then the GPU tests of concurrency, compile (fullgraph, static and
# dynamic, before any eager call), no-token calls and the FP8 / sparse MLA paths, then the rest
# of the MLA GPU tests, then those of the newest kernels (small-layer VQ, transposed MLA). Logs
# and JSON go to OUT (default: $OUT, else ./concurrency-check) as logs.tgz. Run from the repository root on the GPU machine:
#
#   bash tools/concurrency_gpu_check.sh [PYTEST_PROCS]        # default 8; about 6-9 minutes cold
set -uo pipefail
out=${OUT:-concurrency-check}
logs=$out/logs
mkdir -p "$logs"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
procs=${1:-8}
trap 'tar czf "$out/logs.tgz" -C "$out" logs && rm -rf "$logs"' EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$logs/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$logs/gpu.txt"
date -u +%FT%TZ >> "$logs/gpu.txt"
timeout 240 python3 tools/swiglu_graph_race.py "$logs/swiglu-graph-race.json" > "$logs/race.log" 2>&1
echo "graph race rc=$?"; tail -12 "$logs/race.log"
timeout 150 python3 -m tilefuse stress --quick --out "$logs/stress-quick.json" > "$logs/stress.log" 2>&1
echo "stress rc=$?"; tail -25 "$logs/stress.log"
picked="test_concurrency or test_compile_gpu or test_mla_fp8_gluon or fp16_query_never_overflows or compile_every_path"
picked="$picked or gpu_fp8 or gpu_sparse or block_table_per_stream or gpu_compile_and_graphs_with_no_tokens"
picked="$picked or compile_before_any_eager_call_on_gpu or gpu_quick_stress"
timeout 200 python3 -m pytest -q -n "$procs" -m gpu -p no:cacheprovider tests/test_concurrency.py tests/test_compile.py \
    tests/test_stress.py tests/test_mla_fp8_gluon.py tests/test_mla.py tests/test_vq.py tests/test_swiglu.py \
    tests/test_swiglu_fp8.py tests/test_swiglu_nn.py tests/test_swiglu_fp8_nn.py -k "$picked" > "$logs/picked.log" 2>&1
echo "picked GPU tests rc=$?"; grep -E "passed|failed|FAILED|rror" "$logs/picked.log" | tail -15
timeout 150 python3 -m pytest -q -n "$procs" -m gpu -p no:cacheprovider tests/test_mla.py -k "not ($picked)" \
    > "$logs/mla.log" 2>&1
echo "other MLA GPU tests rc=$?"; grep -E "passed|failed|FAILED" "$logs/mla.log" | tail -8
# the kernels newest to the GPU: the small-layer VQ kernel (every GPU test: sizes, settings, odd
# shapes, int8 codes, fp32 codebooks, overflow and NaN) and the transposed MLA form
timeout 150 python3 -m pytest -q -n "$procs" -m gpu -p no:cacheprovider tests/test_vq_small.py tests/test_mla_wgmma_t.py \
    > "$logs/newest.log" 2>&1
echo "newest kernels' GPU tests rc=$?"; grep -E "passed|failed|FAILED" "$logs/newest.log" | tail -8
