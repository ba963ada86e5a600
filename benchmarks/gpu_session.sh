#!/usr/bin/env bash
# The checks and benchmarks to run when a GPU is lent (cuda backend; Ray set up as in
# ../shared/GPU.md). Each part fits one device call (< 10 min); results go to OUT.
#
#   bash benchmarks/gpu_session.sh tests OUT   # the gpu-marked tests
#   bash benchmarks/gpu_session.sh chain OUT   # matmul chain: launch ahead off / on
#   bash benchmarks/gpu_session.sh llama OUT   # llama_prefill 7b-shaped: tiles x launch ahead, torch baselines
set -euo pipefail
part=${1:?usage: gpu_session.sh tests|chain|llama OUT}
out=${2:-gpu_out}
mkdir -p "$out"
llama=(llama_prefill preset=7b layers=4 gpus=1 seq=4096 --capacity 2GiB --backend cuda --repeat 2)
case $part in
tests)
    python -m pytest -q -m gpu tests/test_gpu.py --timeout=600 2>&1 | tee "$out/gpu_tests.log"
    ;;
chain)
    for a in 0 4; do
        python benchmarks/bench_gpu_chain.py --repeat 3 --engines ray --ahead "$a" 2>&1 | tee "$out/chain_ahead$a.log"
    done
    ;;
llama)
    for tile in 512 2048; do
        for a in 0 4; do
            python -m disco_ray bench "${llama[@]}" tile="$tile" --modes dynamic --ahead "$a" \
                --out "$out/llama_t${tile}_a$a" 2>&1 | tee "$out/llama_t${tile}_a$a.log"
        done
    done
    python -m disco_ray bench "${llama[@]}" tile=2048 --modes torch_naive,torch_prefetch \
        --out "$out/llama_torch" 2>&1 | tee "$out/llama_torch.log"
    ;;
*)
    echo "gpu_session.sh: unknown part '$part' (tests, chain or llama)" >&2
    exit 2
    ;;
esac
