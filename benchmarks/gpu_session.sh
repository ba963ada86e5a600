#!/usr/bin/env bash
# The checks and benchmarks to run when a GPU is lent (cuda backend; Ray set up as in
# ../shared/GPU.md). Each part fits one device call (< 10 min); logs and results go to OUT, and
# each part ends by printing its figures.
#
#   bash benchmarks/gpu_session.sh tests OUT             # GPU tests + the stand-in device/NCCL tests
#   bash benchmarks/gpu_session.sh chain OUT             # matmul chain: launch ahead off / on
#   bash benchmarks/gpu_session.sh llama OUT 512 4096    # llama_prefill 7b-shaped per tile: ahead 0 / 4
#   bash benchmarks/gpu_session.sh torch OUT             # llama_prefill: the torch baselines
#   bash benchmarks/gpu_session.sh streams1 OUT          # llama tile 512 on one stream: does the
#                                                        # device gain from several streams?
#   bash benchmarks/gpu_session.sh p2p OUT               # peer-copy bandwidth between two workers
#   bash benchmarks/gpu_session.sh all OUT               # every part in turn (> 10 min: not one call),
#                                                        # then all figures again, gathered
#   bash benchmarks/gpu_session.sh figures OUT           # the figures of the parts already run in OUT
set -euo pipefail
part=${1:?usage: gpu_session.sh tests|chain|llama|torch|streams1|p2p|all|figures OUT [TILE ...]}
out=${2:-gpu_out}
shift $(($# < 2 ? $# : 2))
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
w="llama_prefill preset=7b layers=4 gpus=1 seq=4096" # + tile=T; workload parameters go before options
opts=(--capacity 2GiB --backend cuda --repeat 2)

figures() { # what each part printed that matters, from its logs in $out
    local f
    echo "== figures in $out ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo 'no nvidia-smi'))"
    if [[ -f $out/gpu_tests.log ]]; then
        echo "-- tests"
        tail -n 1 "$out/gpu_tests.log"
    fi
    for f in "$out"/chain_ahead*.log; do
        [[ -f $f ]] || continue
        echo "-- $(basename "$f" .log)"
        grep -E "^(one matmul|in memory:|torch double|disco-ray )" "$f" || true
    done
    for f in "$out"/llama_*.log; do
        [[ -f $f ]] || continue
        echo "-- $(basename "$f" .log)"
        grep -E "^\| |makespan|bound" "$f" | head -n 12 || true
    done
    if [[ -f $out/p2p.log ]]; then
        echo "-- p2p"
        grep -E "^(devices|size| )" "$out/p2p.log" || true
    fi
}

run_part() {
    case $1 in
    tests)
        python -m pytest -q -m "gpu or not gpu" tests/test_gpu.py tests/test_cuda_backend.py tests/test_nccl.py \
            --timeout=600 2>&1 | tee "$out/gpu_tests.log"
        ;;
    chain)
        for a in 0 4; do
            python "$here/bench_gpu_chain.py" --repeat 3 --engines ray --ahead "$a" 2>&1 | tee "$out/chain_ahead$a.log"
        done
        ;;
    llama)
        shift
        for tile in "${@:-2048}"; do
            for a in 0 4; do
                python -m disco_ray bench $w tile="$tile" "${opts[@]}" --modes dynamic --ahead "$a" \
                    --out "$out/llama_t${tile}_a$a" 2>&1 | tee "$out/llama_t${tile}_a$a.log"
            done
        done
        ;;
    torch)
        python -m disco_ray bench $w tile=4096 "${opts[@]}" --modes torch_naive,torch_prefetch \
            --out "$out/llama_torch" 2>&1 | tee "$out/llama_torch.log"
        ;;
    streams1)
        python -m disco_ray bench $w tile=512 "${opts[@]}" --modes dynamic --streams 1 \
            --out "$out/llama_t512_s1" 2>&1 | tee "$out/llama_t512_s1.log"
        ;;
    p2p)
        python "$here/bench_peer_copy.py" --sizes 1MiB,64MiB,512MiB --repeat 5 2>&1 | tee "$out/p2p.log"
        ;;
    *)
        echo "gpu_session.sh: unknown part '$1' (tests, chain, llama, torch, streams1, p2p, all or figures)" >&2
        exit 2
        ;;
    esac
}

case $part in
all)
    for p in tests chain torch streams1 p2p; do
        run_part "$p" || echo "gpu_session.sh: part $p failed" >&2
    done
    run_part llama 512 4096 || echo "gpu_session.sh: part llama failed" >&2
    ;;
figures) ;;
*)
    run_part "$part" "$@"
    ;;
esac
figures
