#!/usr/bin/env bash
# The checks and benchmarks to run when a GPU is lent (../shared/GPU.md, /work/.library/device):
# one part per device call, each bounded by its own `timeout` of PART_S seconds (at most 8
# minutes, inside the device tool's 10-minute call), logs and figures under OUT, and each part
# ends by printing the figures found so far in OUT.
#
#   bash benchmarks/gpu_session.sh PART OUT [TILE]
#
# One device call per part (carry [".whl"]: Ray's wheels, made here by ../shared/tools/gpu-wheels.sh;
# Ray is installed once per machine, into /tmp/site, by the first part that finds it missing):
#   tests      the GPU tests (tests/test_gpu.py: local engine, Ray workers sharing the GPU)
#   standin    the stand-in device and NCCL tests, on the real torch (no GPU used)
#   racecheck  compute-sanitizer --tool racecheck over the local-engine GPU tests
#   decode     new tokens/s, launch ahead 0 and 4, batch 1 and 16 (benchmarks/bench_gpu_decode.py),
#              with the loop's host statistics and max_memory_reserved against the capacity, and
#              transformers' generate on the same prompts, in memory (the peer)
#   decode1    the same on one compute stream (units of a whole decode step: fewer launches)
#   host       the host statistics (launch_us_mean, idle) of a long batch-1 decode, ahead 0 and 4
#   hostbench  the runtime's host cost per vertex on the GPU (benchmarks/bench_host.py --device cuda):
#              weights held (as in decode) with and without kernels, then every input each run; this
#              checkout and each older one named in OLD (before/after)
#   disk       decode with weights="disk" (each load reads the checkpoint) at a small arena
#   lora       one LoRA fine-tuning step, seconds per step (disco-ray finetune --backend cuda)
#   chain      the matmul chain, launch ahead 0 and 4 (benchmarks/bench_gpu_chain.py)
#   llama      llama_prefill 7b-shaped, one TILE (default 2048), ahead 0 and 4
#   torch      llama_prefill: the torch baselines
#   streams1   llama_prefill tile 512 on one stream: does the device gain from several streams?
#   p2p        peer-copy bandwidth between two workers (benchmarks/bench_peer_copy.py)
#   figures    the figures of the parts already run in OUT
# DRY=1 prints the commands a part would run instead of running them (tests/test_gpu_session.py).
set -euo pipefail
PARTS="tests standin racecheck decode decode1 host hostbench disk lora chain llama torch streams1 p2p"
PART_S=${PART_S:-470} # < 8 min: the part, Ray's install and the figures fit one 10-minute call
part=${1:?usage: gpu_session.sh PART OUT [TILE]  (PART: $PARTS, figures)}
out=${2:-gpu_out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
ckpt=${CKPT:-/tmp/bench_llama}
w="llama_prefill preset=7b layers=4 gpus=1 seq=4096" # + tile=T; workload parameters go before options
opts=(--capacity 2GiB --backend cuda --repeat 2)

py() { # python3, or its command line under DRY
    if [[ -n ${DRY:-} ]]; then echo "python3 $(printf '%q ' "$@")"; else python3 "$@"; fi
}

racecheck_py() { # python3 under compute-sanitizer's race detector (a race fails the part)
    local cs=(compute-sanitizer --tool racecheck --target-processes all --error-exitcode 1)
    if [[ -n ${DRY:-} ]]; then echo "${cs[*]} python3 $(printf '%q ' "$@")"; else "${cs[@]}" python3 "$@"; fi
}

ensure_ray() { # Ray's slimmed wheels into /tmp/site, once per machine
    export PYTHONPATH="/tmp/site:$root${PYTHONPATH:+:$PYTHONPATH}"
    [[ -n ${DRY:-} ]] && return 0
    python3 -c "import ray" 2>/dev/null && return 0
    compgen -G "$root/.whl/*.whl" >/dev/null || {
        echo "gpu_session.sh: no Ray, and no wheels in .whl/ (run ../shared/tools/gpu-wheels.sh here, carry .whl)" >&2
        return 2
    }
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$root"/.whl/*.whl
}

figures() { # what each part printed that matters, from its logs in $out
    local f
    echo "== figures in $out ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo 'no nvidia-smi'))"
    for f in "$out"/{tests,standin,racecheck}.log; do
        [[ -f $f ]] && echo "-- $(basename "$f" .log): $(tail -n 1 "$f")"
    done
    for f in "$out"/{decode,decode1,host,disk}.log; do
        [[ -f $f ]] || continue
        echo "-- $(basename "$f" .log)"
        grep -E "^(device|ahead|transformers) " "$f" || true
    done
    [[ -f $out/hostbench.log ]] && { echo "-- hostbench"; grep -E "^(==|streams| +[0-9])" "$out/hostbench.log" || true; }
    [[ -f $out/lora.log ]] && { echo "-- lora"; grep -E "step|s/step|seconds" "$out/lora.log" | tail -n 6 || true; }
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
    [[ -f $out/p2p.log ]] && { echo "-- p2p"; grep -E "^(devices|size| )" "$out/p2p.log" || true; }
    return 0
}

run_part() { # the body of one part (under its timeout)
    local p=$1 a
    shift
    case $p in
    tests) py -m pytest -q -m "gpu or not gpu" tests/test_gpu.py --timeout=300 2>&1 | tee "$out/tests.log" ;;
    standin)
        py -m pytest -q tests/test_cuda_backend.py tests/test_nccl.py tests/test_cuda_release.py \
            tests/test_cuda_disk_loads.py --timeout=300 2>&1 | tee "$out/standin.log"
        ;;
    racecheck) # slow under the sanitizer: the local-engine GPU tests only, the first failure ends it
        racecheck_py -m pytest -q -x -m "gpu and not ray" tests/test_gpu.py 2>&1 | tee "$out/racecheck.log"
        ;;
    decode)
        py "$here/bench_gpu_decode.py" --dir "$ckpt" --batches 1,16 --ahead 0,4 --new 32 --capacity 4GiB \
            --peer --json "$out/decode.json" 2>&1 | tee "$out/decode.log"
        ;;
    decode1)
        py "$here/bench_gpu_decode.py" --dir "$ckpt" --batches 1,16 --ahead 0,4 --new 32 --capacity 4GiB \
            --streams 1 --json "$out/decode1.json" 2>&1 | tee "$out/decode1.log"
        ;;
    host)
        py "$here/bench_gpu_decode.py" --dir "$ckpt" --batches 1 --ahead 0,4 --new 128 --repeat 1 \
            --capacity 4GiB --json "$out/host.json" 2>&1 | tee "$out/host.log"
        ;;
    hostbench) # OLD="dir ..." (checkouts' roots: git archive REV actors disco_ray planner workloads)
        local k o
        for k in --held "--held --no-kernels" ""; do # the decode regime (weights held), then loads each run
            for o in "$root" ${OLD:-}; do
                echo "== bench_host --device cuda ${k:-(every input each run)} on $o" >>"$out/hostbench.log"
                PYTHONPATH="$o:$PYTHONPATH" py "$here/bench_host.py" --device cuda --repeat 7 $k 2>&1 |
                    tee -a "$out/hostbench.log"
            done
        done
        ;;
    disk)
        py "$here/bench_gpu_decode.py" --dir "$ckpt" --batches 1,16 --ahead 4 --new 16 --weights disk \
            --capacity 128MiB --json "$out/disk.json" 2>&1 | tee "$out/disk.log"
        ;;
    lora)
        py "$here/bench_gpu_decode.py" --dir "$ckpt" --checkpoint-only
        py -c "import numpy as np; np.save('$out/lora_ids.npy', np.random.default_rng(0).integers(3, 32000, (4, 512)))"
        py -m disco_ray finetune "$ckpt" --data "$out/lora_ids.npy" --steps 4 --lr 1e-4 --seq-len 512 \
            --batch 1 --capacity 8GiB --backend cuda --engine local --out "$out/lora_adapter" --json \
            2>&1 | tee "$out/lora.log"
        ;;
    chain)
        for a in 0 4; do
            py "$here/bench_gpu_chain.py" --repeat 3 --engines ray --ahead "$a" 2>&1 | tee "$out/chain_ahead$a.log"
        done
        ;;
    llama)
        local tile=${1:-2048}
        for a in 0 4; do
            py -m disco_ray bench $w tile="$tile" "${opts[@]}" --modes dynamic --ahead "$a" \
                --out "$out/llama_t${tile}_a$a" 2>&1 | tee "$out/llama_t${tile}_a$a.log"
        done
        ;;
    torch)
        py -m disco_ray bench $w tile=4096 "${opts[@]}" --modes torch_naive,torch_prefetch \
            --out "$out/llama_torch" 2>&1 | tee "$out/llama_torch.log"
        ;;
    streams1)
        py -m disco_ray bench $w tile=512 "${opts[@]}" --modes dynamic --streams 1 \
            --out "$out/llama_t512_s1" 2>&1 | tee "$out/llama_t512_s1.log"
        ;;
    p2p) py "$here/bench_peer_copy.py" --sizes 1MiB,64MiB,512MiB --repeat 5 2>&1 | tee "$out/p2p.log" ;;
    *)
        echo "gpu_session.sh: unknown part '$p' (one of: $PARTS, figures)" >&2
        return 2
        ;;
    esac
}

cd "$root"
case $part in
figures) ;;
_part) # the part itself, run by the line below under its timeout
    ensure_ray
    run_part "${@:3}"
    exit
    ;;
*)
    [[ " $PARTS " == *" $part "* ]] || {
        echo "gpu_session.sh: unknown part '$part' (one of: $PARTS, figures)" >&2
        exit 2
    }
    rc=0
    timeout --kill-after=10 "$PART_S" bash "$0" _part "$out" "$part" "${@:3}" || rc=$?
    [[ $rc == 124 || $rc == 137 ]] && echo "gpu_session.sh: part $part ran past its $PART_S s and was stopped" >&2
    [[ -z ${DRY:-} ]] && figures
    exit "$rc"
    ;;
esac
figures
