#!/usr/bin/env bash
# Issue 32's GPU measurements, one part per call, each within a 10-minute limit (docs/gpu.md, "Before that
# measurement"). Run from the repository root on a CUDA machine with torch, transformers and triton installed:
#
#   bash benchmarks/gpu_session.sh PART [OUT]
#
# PART: short | short2 | info | tests | profile | eager | compiled-short | compiled-long | torch | pool | kernels | host |
#       host-compiled | kernel-parts | kernel-tune | pool-tune | launch | guards | hybrid | append-only |
#       criticalkv-wide | sanitize | all
# OUT:  where the rows and logs go (default: $OUT if set, else docs/results/gpu_h100); every part writes
#       OUT/PART.log beside its rows, so a part that fails still leaves what it printed.
# The parts are independent; "all" runs them in order (longer than one 10-minute call). "short" is for a session
# with 15 minutes of device time in all (machine start included): one call of at most ~9 minutes that runs the most
# telling measurements first and skips what its deadline (SHORT_SECONDS, default 530) leaves no time for.
set -u
part=${1:?usage: bash benchmarks/gpu_session.sh short|short2|info|tests|profile|eager|compiled-short|compiled-long|torch|pool|kernels|host|host-compiled|kernel-parts|kernel-tune|pool-tune|launch|guards|hybrid|append-only|criticalkv-wide|sanitize|all [OUT]}
out=${2:-${OUT:-docs/results/gpu_h100}}
mkdir -p "$out"
# every compilation of slake's kernels in this call, logged (slake.kernels.compile_log): the next build of Triton's
# cache without a GPU (benchmarks/warm_cache.py, its recorded part) compiles the same specializations, so that they
# load on the next GPU; kept with the rows (docs/results/**/triton_compiles.jsonl)
export SLAKE_TRITON_COMPILE_LOG=${SLAKE_TRITON_COMPILE_LOG:-$out/triton_compiles.jsonl}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
bench=("$py" -m slake.cli bench --random-model llama3-8b --device cuda --budget 1024 --decode-steps 32)

run_part() {
    local name=$1
    echo "== $name $(date -u +%H:%M:%S)"
    case $name in
    info)
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        "$py" -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
        git log -1 --format='%H %s' 2>/dev/null || true
        ;;
    tests)
        # compiled kernels against the torch step, under CUDA graphs, and the paged layouts on the device
        "$py" -m pytest -q -p no:cacheprovider tests/test_fused_decode.py tests/test_fused_decode_wide_rows.py \
            tests/test_fused_decode_launches.py tests/test_fused_decode_models.py tests/test_cuda.py \
            tests/test_paged_layouts.py
        ;;
    profile)
        # where a step's time goes (docs/gpu.md): eager and compiled, per kernel, at 32K for the full cache, snapkv
        # and slake; the fused step's kernels against the model's matmuls and the rest
        "${bench[@]}" --methods full,snapkv,slake --lengths 32768 --compile --profile-steps 8 --out "$out/profile"
        ;;
    eager)
        # the fused step (kernels=auto) in eager decoding, with the full cache beside it in the same run
        "${bench[@]}" --methods full,snapkv,cake,slake --lengths 8192,32768,65536,131072 --out "$out/fused_eager"
        ;;
    compiled-short)
        "${bench[@]}" --methods full,snapkv,cake,slake --lengths 8192,32768 --compile --out "$out/fused_compiled_short"
        ;;
    compiled-long)
        "${bench[@]}" --methods full,slake --lengths 65536,131072 --compile --out "$out/fused_compiled_long"
        ;;
    torch)
        # the torch step at the lengths of the eager targets, for the fused/torch ratio in one session
        "${bench[@]}" --methods snapkv,slake --lengths 8192,65536 --kernels torch --out "$out/torch_eager"
        ;;
    pool)
        # the vLLM pool's step at Llama-3-8B's shape, budget 128: fused, then the torch step
        "$py" -m benchmarks pool-gpu --methods snapkv,cake,slake --requests 8,32 --contexts 2048,8192,32768 \
            --kernels triton > "$out/pool_step_fused.jsonl"
        "$py" -m benchmarks pool-gpu --methods snapkv,slake --requests 8 --contexts 2048 --kernels torch \
            > "$out/pool_step_torch.jsonl"
        ;;
    host)
        # where the eager step's host time goes (cProfile), 8K, budget 1024: the compressed steps beside slake's full
        # cache and transformers' own DynamicCache (the step a user has without slake: is slake's baseline honest?)
        "$py" -m benchmarks host-profile --methods transformers,full,snapkv,cake,slake --length 8192 --budget 1024 \
            --steps 10 > "$out/host_profile.jsonl"
        ;;
    kernel-parts)
        # what each part of SLAKE's second kernel costs at batch 1, budget 1024 (51 µs per layer on the H200): the
        # pool's step as one CUDA graph as it is and with each part left out
        "$py" -m benchmarks kernel-parts --methods slake --budget 1024 --requests 1 > "$out/kernel_parts.jsonl"
        ;;
    pool-tune)
        # the pool's step (8 requests, budget 128: the 40 µs target, met at 36.7 µs by SLAKE on the H200 before the
        # kept order and the new token apart, neither timed on a GPU yet) with each of them turned off, against the
        # step as it is: whether either made the pool's step slower
        "$py" -m benchmarks kernel-tune --methods slake --budget 128 --requests 8 \
            --variants "NEW_TOKEN_APART=0;HELD_ORDER=0" > "$out/pool_tune.jsonl"
        ;;
    kernel-tune)
        # SLAKE's step at batch 1, budget 1024 with other launch constants, each against the step as it is: every
        # row sorted again instead of the order its last step left (what the held order gains), the row's slots
        # padded to pow2(budget + 1) with the new token among them (what keeping it apart gains), the pooling of
        # before (int64 keys through memory), the victim's piece summed 32 slots at a time (the default until
        # 2026-11-28, when 16 removed the kernel's register spill), more pieces combined per round, 16 warps (the whole list, benchmarks.pool.TUNE_VARIANTS, is the command without --variants)
        "$py" -m benchmarks kernel-tune --methods slake --budget 1024 --requests 1 \
            --variants "HELD_ORDER=0;NEW_TOKEN_APART=0;POOL_GATHER=0,SHORT_KEYS=0;RECOMPUTE_BLOCK=32;COMBINE=8;WIDE_WARPS=16" \
            > "$out/kernel_tune.jsonl"
        ;;
    launch)
        # what the launch cache (slake.kernels.launch_cache) and the held steps (slake.kernels.held_step) save an
        # eager step on this host: snapkv and slake at 8K with every launch through Triton's binding, then cached
        # with every step made afresh, then cached and held (as by default), the full cache beside them; and the
        # host-step and launch-cost benchmarks on this machine's CPU (stand-ins for the kernels: Triton's binding
        # against the cache's key)
        SLAKE_CACHED_LAUNCH=0 "${bench[@]}" --methods full,snapkv,slake --lengths 8192 --out "$out/launch_triton"
        SLAKE_CACHED_LAUNCH=1 SLAKE_HELD_STEP=0 "${bench[@]}" --methods snapkv,slake --lengths 8192 \
            --out "$out/launch_afresh"
        SLAKE_CACHED_LAUNCH=1 "${bench[@]}" --methods full,snapkv,slake --lengths 8192 --out "$out/launch_cached"
        TRITON_INTERPRET=1 "$py" -m benchmarks host-step --methods transformers,full,snapkv,slake --repeats 5 > "$out/host_step.jsonl"
        TRITON_INTERPRET=1 "$py" -m benchmarks launch-cost --methods snapkv,slake > "$out/launch_cost.jsonl"
        ;;
    host-compiled)
        # where the host's time around a compiled step's replay goes (cProfile): compiled SLAKE at 8K, budget 1024
        # (1.3 ms of its 9.1 ms step at 128K on the H200; one compile of the 32-layer model)
        "$py" -m benchmarks host-profile --methods slake --length 8192 --budget 1024 --steps 10 --compile \
            > "$out/host_profile_compiled.jsonl"
        ;;
    guards)
        # what dynamo's guards cost a compiled step on this host, all of them and slake's filter (32 layers at
        # Llama-3-8B's widths, 2K tokens: two compiles per method)
        "$py" -m benchmarks compile-guards --methods slake --shape llama3-8b --device cuda --dtype bfloat16 \
            --length 2048 --budget 1024 > "$out/compile_guards.jsonl"
        ;;
    hybrid)
        # compiled decoding of a hybrid model (Gemma 3 4B's shape: 29 sliding-window layers of 1,024 tokens as fixed
        # rings, 5 full-attention layers compressed; docs/compile.md, "Hybrid models"), eager and compiled; about 6
        # minutes with compiles (not timed on a GPU yet)
        "${bench[@]}" --random-model gemma3-4b --methods full,snapkv,slake --lengths 8192,32768 --compile \
            --out "$out/hybrid_compiled"
        ;;
    append-only)
        # kvpress's protocol at long contexts: half of each prompt kept (--budget 0.5), SLAKE evicting at decode
        # (rows of 16K and 32K slots, wider than the second kernel's vectors: read in blocks, triton_wide) and
        # append-only (decode_eviction=false: the kernels of a layer that keeps every slot), beside the full cache;
        # eager, about 4 minutes (not timed on a GPU yet)
        "${bench[@]}" --methods "full,slake,slake[decode_eviction=false]" --budget 0.5 --lengths 32768,65536 \
            --decode-timing interleaved --out "$out/append_only"
        ;;
    criticalkv-wide)
        # CriticalKV's blockwise first stage on rows wider than 16,384 slots (triton_wide's radix select, which since
        # 2026-11-29 reads each slot's position in all 8 passes so that the protected slots take their places first:
        # 13 bytes a slot and pass instead of 5), beside SnapKV's rows of the same width: half of a 64K prompt kept;
        # eager, timed interleaved (not timed on a GPU yet)
        "${bench[@]}" --methods full,snapkv,criticalkv --budget 0.5 --lengths 65536 --decode-timing interleaved \
            --out "$out/criticalkv_wide"
        ;;
    kernels)
        # the fused step alone at the transformers rows' budget: batch 1 (rows split over programs) and 8, per layer
        # as one CUDA graph, fused against the torch step
        "$py" -m benchmarks pool-gpu --methods snapkv,cake,slake --budget 1024 --requests 1,8 --contexts 8192 \
            --kernels triton > "$out/pool_step_fused_1024.jsonl"
        "$py" -m benchmarks pool-gpu --methods snapkv,slake --budget 1024 --requests 1 --contexts 8192 \
            --kernels torch > "$out/pool_step_torch_1024.jsonl"
        ;;
    sanitize)
        sanitize
        ;;
    *)
        echo "unknown part: $name" >&2
        return 2
        ;;
    esac
}

# compute-sanitizer, unpacked from the wheel carried beside the warm cache (`make sanitizer-wheel` puts NVIDIA's
# nvidia-cuda-sanitizer-api wheel in .warm-cache/; run's carry names it), with the files' modes (the launcher execs
# its helpers); prints the binary's path
sanitizer() {
    local whl dir=${SANITIZER_DIR:-/tmp/slake-sanitizer} bin
    bin=$(find "$dir" -path '*/compute-sanitizer/compute-sanitizer' -type f 2>/dev/null | head -n 1)
    if [ -z "$bin" ]; then
        whl=$(ls .warm-cache/nvidia_cuda_sanitizer_api*.whl 2>/dev/null | tail -n 1)
        [ -n "$whl" ] || return 1
        rm -rf "$dir" && mkdir -p "$dir" || return 1
        "$py" - "$whl" "$dir" <<'UNPACK' || return 1
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    for info in wheel.infolist():
        path = wheel.extract(info, sys.argv[2])
        if info.external_attr >> 16:
            os.chmod(path, (info.external_attr >> 16) & 0o777)
UNPACK
        bin=$(find "$dir" -path '*/compute-sanitizer/compute-sanitizer' -type f | head -n 1)
        [ -n "$bin" ] || return 1
    fi
    echo "$bin"
}

# The kernels' tests on the GPU under compute-sanitizer, one tool after another, each within SANITIZE_SECONDS
# (default 90): memcheck (every access inside an allocation: the caching allocator off, so that each tensor is its
# own), initcheck (no read of device memory before a write), synccheck and racecheck (barriers and shared memory,
# Triton's own). The interpreter's bounds check (tests/kernel_bounds.py) and the barriers read off the compiler
# (tests/kernel_hazards.py) are what make test checks of these without a GPU. Each tool's report is
# OUT/sanitize_TOOL.txt, its tests' output OUT/sanitize_TOOL_pytest.txt.
sanitize() {
    local san tool rc tests status=0
    if ! san=$(sanitizer); then
        echo "== no compute-sanitizer: carry .warm-cache/nvidia_cuda_sanitizer_api*.whl (make sanitizer-wheel)"
        return 1
    fi
    "$san" --version | tail -n 1
    for tool in memcheck initcheck synccheck racecheck; do
        tests=(tests/test_fused_decode.py::test_fused_step_equals_the_torch_step_for_every_method
            tests/test_fused_decode.py::test_fused_pool_step_equals_the_torch_pool_step tests/test_dense_attention.py)
        case $tool in synccheck | racecheck)
            tests=("tests/test_fused_decode.py::test_fused_step_equals_the_torch_step_for_every_method[slake]"
                "tests/test_fused_decode.py::test_fused_step_equals_the_torch_step_for_every_method[criticalkv]") ;;
        esac
        echo "== sanitize $tool $(date -u +%H:%M:%S)"
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 5 "${SANITIZE_SECONDS:-90}" "$san" --tool "$tool" \
            --error-exitcode 9 --print-limit 20 --log-file "$out/sanitize_$tool.txt" \
            "$py" -m pytest -q -p no:cacheprovider "${tests[@]}" > "$out/sanitize_${tool}_pytest.txt" 2>&1
        rc=$?
        echo "== $tool: exit $rc (0: clean; 9: the tool reported an error; 124: out of time; else a test failed)"
        tail -n 4 "$out/sanitize_$tool.txt" 2>/dev/null
        tail -n 2 "$out/sanitize_${tool}_pytest.txt"
        [ $rc -eq 0 ] || status=1
    done
    return $status
}

# short: the parts that decide issue 32's targets, most telling first, each started only if its estimate fits
# before the deadline; every step leaves its rows and log under OUT even when a later one is skipped. The estimates
# are what each took on the H200 of 2026-11-27 (Triton's and inductor's compiles included: a fresh machine has no
# cache). Wrap it so that OUT comes back whatever happens, and pack it (the device tool returns at most 8 files):
#   timeout -k 5 560 bash benchmarks/gpu_session.sh short /tmp/gpu; tar -C /tmp -czf "$OUT/gpu.tgz" gpu
# short2 is the same for a second call on the still-warm machine, with what short leaves out, its deadline set to
# the device time left (SHORT_SECONDS=270 after a first call of about 8 minutes in a 15-minute session):
#   SHORT_SECONDS=270 timeout -k 5 300 bash benchmarks/gpu_session.sh short2 /tmp/gpu2; tar -C /tmp -czf "$OUT/gpu2.tgz" gpu2
# The order since the fourth H200 session (2026-11-30), which timed every target's rows (compiled at 128K and 32K,
# the eager targets interleaved, the pool's step): first what no session has measured and what says where the
# targets' remaining time goes, the eager step's host work beside transformers' own cache (host), the parts of
# SLAKE's second kernel and the fused step alone at batch 1 (kernel-parts, kernels-1: 1.0 of compiled SLAKE's 6.2 ms
# of kernels at 128K), then the target rows again (compiled-128k: the compiled full cache without its search for a
# free slot since; eager-targets); smoke's estimate includes the wait for the warm-up bench beside it (the smoke
# tests alone took 134 s).
SHORT_STEPS=("info 10" "smoke 250" "host 70" "kernel-parts 90" "kernels-1 130" "compiled-128k 270" "eager-targets 200")
SHORT2_STEPS=("compiled-128k 270" "kernel-tune 115" "host-compiled 80" "launch 170" "eager-targets 200" "pool-tune 50" \
    "compiled-32k 90" "pool-8 65" "profile 200" "criticalkv-wide 150")

# Triton's cache of the fused kernels built without a GPU (benchmarks/warm_cache.py, `make warm-cache`), when the call
# carried it (run's carry: .warm-cache/triton-sm90.tgz) and it was built for this machine's Triton and GPU: the
# kernels load from it instead of compiling (about 200 s of the third H200 session's first eager run). If it does
# not fit, nothing changes: every kernel compiles as before. warm_cache_report says, at the end of a call, which
# fused kernels compiled anyway (a specialization the build did not cover).
warm_cache() {
    local dir
    # this machine's Triton key, for a later build that needs no wheel (benchmarks/warm_cache.py build --key-file)
    "$py" -m benchmarks.warm_cache key > "$out/triton_key.txt" || true
    if [ -f .warm-cache/triton-sm90.tgz ]; then
        if dir=$("$py" -m benchmarks.warm_cache install .warm-cache/triton-sm90.tgz); then
            export TRITON_CACHE_DIR=$dir
            echo "== warm cache: TRITON_CACHE_DIR=$dir"
        fi
    else
        echo "== warm cache: none carried (.warm-cache/triton-sm90.tgz); the kernels compile on first use"
    fi
}
warm_cache_report() {
    if [ -n "${TRITON_CACHE_DIR:-}" ]; then
        echo "== warm cache: $("$py" -m benchmarks.warm_cache report --cache-dir "$TRITON_CACHE_DIR")"
    fi
}

run_short() {
    local deadline=$((SECONDS + ${SHORT_SECONDS:-530}))
    local step estimate
    warm_cache
    for step in "$@"; do
        set -- $step
        estimate=$2
        if [ $((SECONDS + estimate)) -gt $deadline ]; then
            echo "== skipped $1: about ${estimate}s needed, $((deadline - SECONDS))s left"
            continue
        fi
        case $1 in smoke | eager-targets | compiled-targets | compiled-128k | compiled-32k | pool-8 | kernels-1) echo "== $1 $(date -u +%H:%M:%S)" ;; esac
        case $1 in
        smoke)
            # the kernels compiled for this GPU against the torch step (the pooling's sort and gathers on the GPU
            # first met there), CUDA-graph capture, and the full cache's unmasked attention without cuDNN. Beside it,
            # on other cores, a short bench of the eager methods fills Triton's cache on disk: a fresh machine spent
            # 200 s of eager-targets' 280 s compiling (slake's first configuration 133 s, cake's 55 s; 2026-11-28),
            # and nothing is timed until it is done (the wait below)
            "${bench[@]}" --methods snapkv,cake,slake --lengths 8192,65536 --decode-steps 1 --warmup 1 --no-plots \
                --no-progress --decode-timing sequential --out "$out/warm" > "$out/warm.log" 2>&1 &
            local warm=$!
            "$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py \
                "tests/test_fused_decode.py::test_fused_step_equals_the_torch_step_for_every_method" \
                tests/test_fused_decode.py::test_the_position_order_ranks_valid_slots_by_position_with_keys_of_either_width \
                tests/test_fused_decode.py::test_the_victim_found_among_ranks_is_the_one_argmin_finds_among_slots \
                tests/test_fused_decode.py::test_a_held_order_is_used_only_when_it_proves_to_be_the_sorted_order \
                tests/test_fused_decode.py::test_the_fused_step_keeps_each_rows_order_and_survives_a_corrupted_one \
                tests/test_fused_decode.py::test_the_pooling_with_the_new_token_apart_pools_the_row_in_position_order \
                -k "test_cuda or slake or snapkv or cake or position_order or ranks or held_order or rows_order \
                    or new_token_apart" 2>&1 \
                | tee "$out/smoke.log" | tail -n 5
            wait "$warm" || echo "== the warm-up bench failed (its log: warm.log); the kernels compile when first timed"
            if grep -q "FAILED.*test_cached_launches" "$out/smoke.log"; then
                # launches that skip Triton's binding failed on this GPU: the measurements after go through Triton
                export SLAKE_CACHED_LAUNCH=0
                echo "== the cached launches failed on this GPU: what follows runs with SLAKE_CACHED_LAUNCH=0"
            fi
            if grep -q "FAILED.*test_held_steps" "$out/smoke.log"; then
                # the eager steps held with their arguments made once failed on this GPU: what follows makes them
                # at every step
                export SLAKE_HELD_STEP=0
                echo "== the held steps failed on this GPU: what follows runs with SLAKE_HELD_STEP=0"
            fi
            if grep -q "FAILED.*held_order\|FAILED.*rows_order" "$out/smoke.log"; then
                # the slot order kept from step to step failed on this GPU: the measurements after sort every row
                export SLAKE_HELD_ORDER=0
                echo "== the kept slot order failed on this GPU: what follows runs with SLAKE_HELD_ORDER=0"
            fi
            if grep -q "FAILED.*new_token_apart\|FAILED.*victim_found_among_ranks" "$out/smoke.log"; then
                # the pooled rules' eviction with the new token apart failed on this GPU: the measurements after pool
                # the row's slots with the new token among them
                export SLAKE_NEW_TOKEN_APART=0
                echo "== the new token apart failed on this GPU: what follows runs with SLAKE_NEW_TOKEN_APART=0"
            fi
            ;;
        eager-targets)
            # the eager targets against the full cache's unmasked step without cuDNN (its baseline since 2026-11-27;
            # compiled-targets' profile names the full cache's attention kernel); then transformers' own
            # DynamicCache at the same lengths (the decode without slake: is slake's full cache an honest baseline
            # there?). Timed interleaved (one step of each configuration in turn, 32 rounds): on the H200 of
            # 2026-11-28 the host's speed changed by up to 2x between runs and within one (docs/gpu.md, "third
            # session"), and a ratio of two sequential medians said nothing; decode_vs_first is each row's median
            # step ratio to the full cache's (the first), a slowdown of the host cancels in it
            "${bench[@]}" --methods full,transformers,snapkv,cake,slake --lengths 8192,65536 \
                --decode-timing interleaved --out "$out/eager_targets"
            ;;
        compiled-targets)
            # compiled SLAKE at 32K (the row issue 32 asks for) and 128K beside the full cache, eager and compiled;
            # the full cache's eager 128K row is the 10x target's baseline, the profile says what is above the weights
            "${bench[@]}" --methods full,slake --lengths 32768,131072 --compile --profile-steps 8 \
                --out "$out/compiled_targets"
            ;;
        compiled-128k)
            # compiled SLAKE and the full cache at 128K alone, eager and compiled, with their profile: the 10x and
            # 1.5x targets' rows, and the compiled full cache with its attention split over the keys
            # (slake.kernels.triton_dense; cuDNN's unsplit kernel made it 148 ms per token before)
            "${bench[@]}" --methods full,slake --lengths 131072 --compile --profile-steps 8 --out "$out/compiled_128k"
            ;;
        compiled-32k)
            # compiled SLAKE's 32K row, which issue 32 asks for and no GPU session has measured since its CUDA-graph fix
            "${bench[@]}" --methods slake --lengths 32768 --compile --out "$out/compiled_32k"
            ;;
        kernels-1)
            # the fused step alone at batch 1, budget 1024, per layer as one CUDA graph: the kernels' own time; beside
            # it plain SDPA (no mask) over a dense 8K and 128K cache, the full cache's attention at the bandwidth the
            # bench's masked full-cache step does not reach (docs/gpu.md, "the full cache's baseline")
            "$py" -m benchmarks pool-gpu --methods snapkv,cake,slake --budget 1024 --requests 1 --contexts 8192,131072 \
                --kernels triton > "$out/pool_step_fused_1024_b1.jsonl"
            ;;
        pool-8)
            # the pool's 40 µs-per-layer target: 8 requests of 2K, budget 128, fused then torch
            "$py" -m benchmarks pool-gpu --methods snapkv,cake,slake --requests 8 --contexts 2048 \
                --kernels triton > "$out/pool_step_fused_8x2k.jsonl"
            "$py" -m benchmarks pool-gpu --methods snapkv,slake --requests 8 --contexts 2048 --kernels torch \
                > "$out/pool_step_torch_8x2k.jsonl"
            ;;
        *)
            run_part "$1"
            ;;
        esac
    done
    warm_cache_report
}

if [ "$part" = short ]; then
    run_short "${SHORT_STEPS[@]}" 2>&1 | tee "$out/short.log"
    exit "${PIPESTATUS[0]}"
fi
if [ "$part" = short2 ]; then
    run_short "${SHORT2_STEPS[@]}" 2>&1 | tee "$out/short2.log"
    exit "${PIPESTATUS[0]}"
fi

if [ "$part" = all ]; then
    status=0
    for p in info tests profile eager compiled-short compiled-long torch pool kernels host host-compiled kernel-parts kernel-tune \
        pool-tune launch guards hybrid append-only criticalkv-wide; do
        run_part "$p" 2>&1 | tee "$out/$p.log" || status=1
    done
    exit $status
fi
run_part "$part" 2>&1 | tee "$out/$part.log"
exit "${PIPESTATUS[0]}"
