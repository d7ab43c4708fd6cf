#!/usr/bin/env bash
# The Gluon MLA kernel's transposed form (kernels_gluon_t) in one device call, inside DEADLINE
# seconds (default 300; AB_TIMEOUT for the A/B, default 40; TESTS=0 / AB=0 / PEERS=0 leave a step out):
#   1. the FlashMLA peers (main's dense decode and b31bfe7, sources in .peers/ as
#      flashmla-main.tar.xz / flashmla-b31bfe7.tar.xz) build on the CPU in the background, while
#      the GPU runs the form's GPU tests (tests/test_mla_wgmma_t.py) beside a warm-up of the
#      per-layer bench's compiles (correctness only: they share the GPU);
#   2. the held-out A/B (tools/mla_wgmma_t_ab.py), alone on the GPU (with the peers: PEERS_IN_AB=1);
#   3. the per-layer bench (tools/mla_perlayer_bench.py --lean: tilefuse bench mla --quick's 16-bit
#      dense cases with tilefuse:wgmma-t beside the default and both peers; the forced tl kernels
#      and torch_naive left out) until the deadline; its rows are saved after every case.
# Logs (logs.tgz) and the JSON results go to OUT (default: $OUT, else ./wgmma-t-check). Run from
# the repository root on the GPU machine.
#
#   DEADLINE=300 bash tools/mla_wgmma_t_gpu_check.sh
#   PEERS=0 AB_TIMEOUT=60 bash tools/mla_wgmma_t_gpu_check.sh     # tests and the A/B alone (no FlashMLA, no bench)
#   TESTS=0 AB=0 DEADLINE=560 BENCH_FLAGS=--lean bash tools/mla_wgmma_t_gpu_check.sh   # the per-layer bench alone
set -uo pipefail
out=${OUT:-wgmma-t-check}
mkdir -p "$out/logs" "$out/results"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
deadline=${DEADLINE:-300}
t0=$SECONDS
el() { echo "[$((SECONDS - t0))s] $*" | tee -a "$out/logs/steps.log"; }
left() { echo $((deadline - (SECONDS - t0))); }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > "$out/logs/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$out/logs/steps.log"

peers=/tmp/flashmla-peers
builds=()
if [ "${PEERS:-1}" = 1 ] && [ -f .peers/flashmla-main.tar.xz ] && [ -f .peers/flashmla-b31bfe7.tar.xz ]; then
    mkdir -p $peers
    tar -xJf .peers/flashmla-main.tar.xz -C $peers && tar -xJf .peers/flashmla-b31bfe7.tar.xz -C $peers
    (cd $peers/main && CPATH=$CUDA_HOME/include/cccl:${CPATH:-} FLASH_MLA_DISABLE_FP16=1 FLASH_MLA_DISABLE_SM100=1 \
        NVCC_THREADS=4 MAX_JOBS=8 timeout 130 python3 setup.py build_ext --inplace > "$out/logs/build-main.log" 2>&1;
        echo "build main rc $?" >> "$out/logs/steps.log") &
    builds+=($!)
    (cd $peers/b31 && CPATH=$CUDA_HOME/include/cccl:${CPATH:-} FLASH_MLA_DISABLE_FP16=TRUE NVCC_THREADS=4 MAX_JOBS=4 \
        timeout 130 python3 setup.py build_ext --inplace > "$out/logs/build-b31.log" 2>&1;
        echo "build b31 rc $?" >> "$out/logs/steps.log") &
    builds+=($!)
fi
el "peer builds started: ${#builds[@]}"

# 1. GPU tests (three processes; TESTS=0: none) and the bench's compiles, beside the builds
t1= t2= t4=
if [ "${TESTS:-1}" = 1 ]; then
timeout ${TEST_TIMEOUT:-110} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mla_wgmma_t.py -k "edges and (16 or 32-)" \
    > "$out/logs/pytest-edges1.log" 2>&1 &
t1=$!
timeout ${TEST_TIMEOUT:-110} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mla_wgmma_t.py -k "edges and not (16 or 32-)" \
    > "$out/logs/pytest-edges2.log" 2>&1 &
t2=$!
timeout ${TEST_TIMEOUT:-110} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mla_wgmma_t.py -k "not edges" \
    > "$out/logs/pytest-rest.log" 2>&1 &
t4=$!
fi
t3=
if [ "${PEERS:-1}" = 1 ]; then
    timeout 90 python3 tools/mla_perlayer_bench.py --warm ${BENCH_FLAGS:---lean --few-rows-first} > "$out/logs/warm.log" 2>&1 &
    t3=$!
fi
if [ "${TESTS:-1}" = 1 ]; then
    wait $t1; r1=$?
    wait $t2; r2=$?
    wait $t4; r4=$?
    el "gpu tests done: rc $r1 $r2 $r4: $(grep -h -E '(passed|failed)' "$out"/logs/pytest-*.log | tr '\n' ' ')"
    grep -h -E "^(FAILED|ERROR)" "$out"/logs/pytest-*.log | head -20
fi
if [ -n "$t3" ]; then
    wait $t3
    el "warm-up done: $(grep -c '^\[warm' "$out/logs/warm.log") cases"
fi

# 2. the held-out A/B (the transposed form against the default), alone on the GPU while the peers
#    may still build (FlashMLA beside it only where PEERS_IN_AB=1: it then waits for the builds)
ab_peers() {
    for pid in "${builds[@]}"; do wait "$pid"; done
    el "builds done"
    fm=""
    for b in main:main b31bfe7:b31; do
        dir=$peers/${b#*:}
        if [ -d "$dir" ] && (cd /tmp && PYTHONPATH=$dir python3 -c "import flash_mla" >> "$out/logs/steps.log" 2>&1); then
            fm="$fm,${b%%:*}=$dir"
        fi
    done
    export TILEFUSE_FLASHMLA=${fm#,}
    el "TILEFUSE_FLASHMLA=$TILEFUSE_FLASHMLA"
}
[ "${PEERS_IN_AB:-0}" = 1 ] && ab_peers
if [ "${AB:-1}" = 1 ]; then
    timeout ${AB_TIMEOUT:-40} python3 tools/mla_wgmma_t_ab.py "$out/results/mla-wgmma-t.json" --rep-ms 5 \
        > "$out/logs/ab.log" 2>&1
    el "held-out A/B rc $?"
    grep "^#" "$out/logs/ab.log"
fi
[ "${PEERS_IN_AB:-0}" = 1 ] || [ "${PEERS:-1}" != 1 ] || ab_peers

# 3. the per-layer bench until the deadline (its rows are saved after every case); PEERS=0: none
if [ "${PEERS:-1}" = 1 ]; then
    budget=$(( $(left) - 8 ))
    [ $budget -lt 20 ] && budget=20
    timeout $budget python3 tools/mla_perlayer_bench.py --out "$out/results" --tag perlayer --rep-ms 10 --eager-ms 10 \
        ${BENCH_FLAGS:---lean --few-rows-first} > "$out/logs/bench.log" 2>&1
    el "bench rc $? (timeout $budget s)"
    grep -c "^\[mla " "$out/logs/bench.log"
    tail -5 "$out/logs/bench.log"
fi
tar czf "$out/logs.tgz" -C "$out" logs && rm -rf "$out/logs"
ls -la "$out" "$out/results"
