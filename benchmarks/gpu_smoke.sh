#!/usr/bin/env bash
# GPU smoke kit: one command on a lent GPU machine (one H100 80GB or H200; see benchmarks/README.md,
# section "GPU smoke kit"). Through the device tool:  run(carry=[".whl"], command="bash benchmarks/gpu_smoke.sh")
#
#   0. installs the carried wheels (.whl/*.whl: megatron-core) into /tmp/site, prints the device
#   a. [tests] python3 -m pytest -q -m gpu tests/gpu tests/weight_sync/test_cuda_ipc.py  (EMPG_GPU_RESULTS_DIR = the
#      output folder): two RL steps through empg train; the sdpa backend's CUDA paths and the fusions
#      without TE against fp32 references (attention_gpu.json); the context-parallel attention's
#      varlen path for simulated CP ranks against sdpa on the full row (cp_attention_gpu.json)
#      (the grouped experts' test runs in part moe instead when that part runs)
#   a2. [kernels] benchmarks/topk_kernel.py --device cuda: the old pass's stats call at k = 32 with the
#      torch top-k, the Triton top-k, and at k = 0, 16,384 tokens x 151,936 bf16 (check, ratio, kernel
#      sweep)                                                          -> topk_kernel_gpu.json
#   m. [moe] pytest tests/gpu/test_grouped_experts_gpu.py: GroupedExperts through grouped_mm in bf16
#      against SequentialMLP and fp32 at Qwen3-30B-A3B's expert shape, no host sync
#                                                                      -> grouped_experts_gpu.json
#   b3. [moe] benchmarks/train_step.py on a mixture of experts (the MoE part in benchmarks/moe_step.py),
#      issue 44's measurement: Qwen3-30B-A3B's dimensions at SMOKE_MOE_LAYERS (4) of its 48 layers
#      (128 experts, top-8), bf16, EP 1 (no all-to-all), 8k-token packed rows, 32k tokens per step,
#      the whole RL step (old, anchor, update, optimizer, EMA); grouped experts (3 timed steps) then
#      sequential (1 timed step) in the same process: tokens/s, MFU over the active parameters, the
#      MoE blocks' own time and MFU, the output layer's share, peak against empg plan, grouped /
#      sequential
#                                                                      -> train_step_moe_gpu.json
#   b. [dense] benchmarks/train_step.py, R1-Distill-Qwen-1.5B bf16, DP 1, 32k tokens per step, the 8k
#      recipe's loss, packed rows of one sequence each (the worst case of a budget)
#                                                                      -> train_step_gpu.json
#      unfused vs sdpa at 2k (the A/B), sdpa at 8k (k3, Top-k, forward passes at 16k), sdpa at 16k
#      and 24k with full recompute; one checkpoint save against a plain write of the same bytes;
#      each case's time by op class from one more, profiled step (--profile: time_by_op_class)
#   b2. [dense or moe] benchmarks/plan_vs_gpu.py on those results: the memory plan (empg plan) against
#      each configuration's measured peaks, dense and MoE, printed (within 10 % is the goal; 5 % is
#      issue 44's for the MoE step)
#   c. (SMOKE_KERNELS=1) the vocab kernels (vocab_kernel_gpu.json), measured in an earlier run and
#      not repeated by default
#   then a summary table (last in the output).
#
#   d. [lora] benchmarks/train_step.py: the 8k sdpa case with LoRA adapters (rank 64, every linear;
#      train_step_lora_gpu.json): step time, tokens/s, peak against the plan, beside the dense part's
#      full fine-tuning (MFU counts the frozen base's backward once: 4 passes, not 5)
#   g. [ckpt] benchmarks/checkpoint_save.py --async-save: the 1.5B's whole training state (about 32 GB)
#      saved in the background (checkpoint.async_save): the blocking seconds (goal <= 1 s), the
#      persist seconds, the step's slowdown while it writes (goal <= 2 %), beside the blocking save
#      against a plain write of the same bytes              -> checkpoint_save_gpu.json
#   h. [loop] benchmarks/whole_loop.py: empg train for 3 steps at the 1.5B's dimensions (random weights),
#      the transformers engine in-process and sleeping between rollouts, bf16: each phase's time and
#      device peak against empg plan's (goal: within 5 %)  -> whole_loop_gpu.json
#   f. [fp8] benchmarks/fp8_anchor.py: issue 47's FP8 anchor at the 1.5B's dimensions, 4 packed 8k rows:
#      the torch FP8 anchor against the bf16 one (pass time, bytes, log-prob error, KL)
#                                                                      -> fp8_anchor_gpu.json
#      (tests/gpu/test_fp8_anchor_gpu.py, in part tests: scaled_mm against the emulated product,
#      the Triton row quantization, no host sync -> fp8_anchor_gpu_test.json)
#
# Parts. SMOKE_PARTS (comma-separated, default tests,kernels,moe,dense,lora,fp8,ckpt,loop: all, in that order) picks the
# steps by their [part]; each part runs alone, e.g. the MoE measurement by itself (~3-4 min):
#     SMOKE_PARTS=moe bash benchmarks/gpu_smoke.sh
# and the rest in another call:  SMOKE_PARTS=tests,kernels,dense bash benchmarks/gpu_smoke.sh
# The whole kit's steps sum to about 480 s by estimate (the MoE part never ran yet): inside the
# budget, but with little to spare, so where device time allows run the two calls above. The moe
# part runs before dense so that the budget never cuts it.
#
# Everything the steps print goes to smoke.log too; results land in ${OUT:-benchmarks/results}. The
# device tool returns at most 8 files: when a run leaves more (all parts: 9), the tests' small JSON
# files (smoke_*.json, attention_gpu.json, cp_attention_gpu.json, grouped_experts_gpu.json,
# fp8_anchor_gpu_test.json) are
# packed into gpu_tests_json.tar (tar xf to unpack; their contents are in smoke.log's summary too).
# Each step has a time cap and the whole run a budget (SMOKE_BUDGET_S, default 540 s) so that it ends
# inside the device tool's 10 minutes; a step that fails or runs out of time is recorded and the
# next one still runs. Exit status: 0 when every step passed, 1 otherwise. SMOKE_CPU_DRY_RUN=1 runs
# the same flow on a CPU at toy sizes (a check of this script, not a measurement).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)
OUT_DIR=${OUT:-benchmarks/results}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOG="$OUT_DIR/smoke.log"
: >"$LOG"
PY=${PYTHON:-python3}
DRY=${SMOKE_CPU_DRY_RUN:-0}
BUDGET=${SMOKE_BUDGET_S:-540}
export PYTHONUNBUFFERED=1
START=$SECONDS

log() { echo "$@" | tee -a "$LOG"; }

# ---------------------------------------------------------------- 0. wheels, device
if [[ "$DRY" != 1 ]] && compgen -G ".whl/*.whl" >/dev/null; then  # (a CPU dry run uses its own environment)
    log "installing carried wheels: $(cd .whl && echo ./*.whl)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tee -a "$LOG"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # the package is used from the checkout

log "== device"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG" || true
    GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 || true)
    GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n1 | tr -dc '0-9' || true)
    GPU_MIB=${GPU_MIB:-0}
else
    log "nvidia-smi: not found"
    GPU_NAME=none
    GPU_MIB=0
fi
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib, sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA (torch) {torch.version.cuda}, "
      f"cuda available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
          f"capability {torch.cuda.get_device_capability(0)}")
for name in ("megatron.core", "transformer_engine", "transformers", "triton", "vllm"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')} ({m.__file__})")
    except Exception as err:  # noqa: BLE001
        print(f"{name}: not importable ({type(err).__name__})")
EOF
if [[ "$DRY" != 1 ]] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    log "no CUDA device visible to torch: nothing to measure (SMOKE_CPU_DRY_RUN=1 checks the flow on a CPU)"
    exit 1
fi

# peak dense bf16 TFLOP/s for the MFU (datasheet; SMOKE_PEAK_TFLOPS overrides)
case "$GPU_NAME" in
    *H200*) PEAK=989 ;;
    *H100*PCIe*) PEAK=756 ;;
    *H100*NVL*) PEAK=835 ;;
    *H100*) PEAK=989 ;;
    *) PEAK="" ;;
esac
PEAK=${SMOKE_PEAK_TFLOPS:-$PEAK}
MODEL=deepseek-r1-distill-qwen-1.5b
VK_ARGS=(--device cuda --tokens 16384 --vocab 151936 --ids 33 --warmup 3 --repeats 10)
VK_ENV=()
TK_ARGS=(--device cuda --tokens 16384 --vocab 151936 --k 32 --warmup 2 --repeats 5 --torch-repeats 2)
TK_ENV=()
TOPK_ARGS=(--device cuda --tokens 16384 --tp 1 --warmup 3 --repeats 10
    --sweep-tokens 16384 --sweep-chunks "1024,4096" --sweep-variants ours_vp_inplace)
TRAIN_ARGS=(--model "$MODEL" --dtype bf16 --tokens-per-step 32768 --warmup 1 --repeats 2 --checkpoint --profile
    --checkpoint-dir "${SMOKE_CHECKPOINT_DIR:-/tmp/empg_ckpt}" ${PEAK:+--peak-tflops "$PEAK"})
TRAIN_CASES=(--case attention=unfused,tokens=2048 --case attention=sdpa,tokens=2048
    --case attention=sdpa,tokens=8192 --case attention=sdpa,tokens=8192,kl=topk
    --case attention=sdpa,tokens=8192,forward_tokens=16384
    --case attention=sdpa,tokens=16384,recompute=full --case attention=sdpa,tokens=24576,recompute=full)
MOE_ARGS=(--model qwen3-30b-a3b --num-layers "${SMOKE_MOE_LAYERS:-4}" --moe-experts "${SMOKE_MOE_EXPERTS:-grouped,sequential}"
    --dtype bf16 --tokens-per-step 32768 --warmup 1 --repeats 3 --sequential-repeats 1 ${PEAK:+--peak-tflops "$PEAK"})
MOE_CASES=(--case attention=sdpa,tokens=8192)
# LoRA (docs/lora.md): the dense part's sdpa 8k case with adapters of rank 64 on every linear
LORA_ARGS=(--model "$MODEL" --dtype bf16 --tokens-per-step 32768 --warmup 1 --repeats 2 ${PEAK:+--peak-tflops "$PEAK"}
    --model-override lora.rank=64 --model-override lora.alpha=128 --model-override "lora.targets=[all-linear]")
LORA_CASES=(--case attention=sdpa,tokens=8192)
FP8_ARGS=(--model "$MODEL" --tokens 8192 --seq 1024 --micro-batches 4 --fp8 torch)
LOOP_ARGS=(--model "$MODEL" --steps 3 --dtype bfloat16)
CKPT_ARGS=(--model "$MODEL" --model-overrides "" --dtype bf16 --repeats 2 --settle 2 --async-save
    --dir "${SMOKE_CHECKPOINT_DIR:-/tmp/empg_ckpt}")
if [[ "$DRY" == 1 ]]; then  # toy sizes on a CPU: exercises the flow only
    # the kernels under Triton's interpreter (vocab_kernel.py also sets it for --device cpu)
    VK_ARGS=(--device cpu --tokens 16 --vocab 512 --ids 33 --warmup 1 --repeats 1 --copy-gb 0.01 --sweep 256:4)
    VK_ENV=(TRITON_INTERPRET=1)
    TK_ARGS=(--device cpu --tokens 16 --vocab 512 --k 32 --warmup 1 --repeats 1 --torch-repeats 1 --copy-gb 0.01
        --sweep 256:4)
    TK_ENV=(TRITON_INTERPRET=1)
    TOPK_ARGS=(--device cpu --tokens 256 --vocab 4096 --tp 1 --repeats 2 --sweep-tokens 256 --sweep-chunks 128
        --sweep-variants ours_vp_inplace --no-tracked)
    TRAIN_ARGS=(--model tiny-qwen2 --dtype fp32 --tokens-per-step 512 --warmup 1 --repeats 1 --checkpoint
        --checkpoint-dir "${TMPDIR:-/tmp}/empg_ckpt_dry")
    TRAIN_CASES=(--case attention=unfused,tokens=128 --case attention=sdpa,tokens=128
        --case attention=sdpa,tokens=256,kl=topk --case attention=sdpa,tokens=512,recompute=full)
    MOE_ARGS=(--model tiny-qwen3-moe --num-layers 4 --moe-experts grouped,sequential --dtype fp32
        --tokens-per-step 256 --warmup 1 --repeats 1 --sequential-repeats 1)
    MOE_CASES=(--case attention=sdpa,tokens=128)
    LORA_ARGS=(--model tiny-qwen2 --dtype fp32 --tokens-per-step 512 --warmup 1 --repeats 1
        --model-override lora.rank=4 --model-override "lora.targets=[all-linear]")
    LORA_CASES=(--case attention=sdpa,tokens=128)
    FP8_ARGS=(--fp8 emulated)
    LOOP_ARGS=(--steps 2)
    CKPT_ARGS=(--model tiny-qwen2 --model-overrides "" --dtype fp32 --repeats 1 --settle 0 --async-save
        --dir "${TMPDIR:-/tmp}/empg_ckpt_dry")
fi

# ---------------------------------------------------------------- steps
STEPS=()
step() {  # step NAME CAP_S CMD...: run with a time cap (within the budget), output into the log
    local name=$1 cap=$2
    shift 2
    local left=$((BUDGET - (SECONDS - START)))
    ((cap > left)) && cap=$left
    if ((cap < 30)); then
        log "== $name: SKIPPED (budget of ${BUDGET} s spent)"
        STEPS+=("$name|skipped|0")
        return 0
    fi
    log "== $name (cap ${cap} s): $*"
    local t0=$SECONDS rc
    set +e
    timeout --kill-after=20 "$cap" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    set -e
    local status=ok
    ((rc == 124 || rc == 137)) && status="timeout (${cap} s)"
    ((rc != 0 && rc != 124 && rc != 137)) && status="failed (rc $rc)"
    log "== $name: $status in $((SECONDS - t0)) s"
    STEPS+=("$name|$status|$((SECONDS - t0))")
}

SMOKE_PARTS=${SMOKE_PARTS:-tests,kernels,moe,dense,lora,fp8,ckpt,loop}
PARTS=",$SMOKE_PARTS,"
part() { [[ "$PARTS" == *",$1,"* ]]; }
for p in ${SMOKE_PARTS//,/ }; do
    [[ "$p" =~ ^(tests|kernels|moe|dense|lora|fp8|ckpt|loop)$ ]] || { log "SMOKE_PARTS: unknown part '$p' (tests, kernels, moe, dense, lora, fp8, ckpt, loop)"; exit 2; }
done
log "== parts: ${PARTS:1:${#PARTS}-2}"
pytest_counts() {  # pytest's own count (a skip on the GPU machine is no pass): appended to the last step's status
    local counts
    counts=$(grep -E '^=* ?[0-9]+ (passed|failed|skipped|errors?|deselected)' "$LOG" | tail -n1 | tr -d '=' | sed -E 's/^ +| +$//g' || true)
    [[ -n "$counts" ]] && STEPS[-1]="${STEPS[-1]%%|*}|$(cut -d'|' -f2 <<<"${STEPS[-1]}"): $counts|${STEPS[-1]##*|}"
    return 0
}
GROUPED_TEST=tests/gpu/test_grouped_experts_gpu.py

if part tests; then
    IGNORE=()
    part moe && IGNORE=(--ignore="$GROUPED_TEST")  # the moe part runs it
    step "gpu tests (pytest -m gpu tests/gpu tests/weight_sync/test_cuda_ipc.py)" 140 \
        env EMPG_GPU_RESULTS_DIR="$OUT_DIR" "$PY" -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/gpu \
        tests/weight_sync/test_cuda_ipc.py "${IGNORE[@]}"
    pytest_counts
fi
if part kernels; then
    step "topk_kernel ${TK_ARGS[*]:0:2}" 50 \
        env "${TK_ENV[@]}" "$PY" benchmarks/topk_kernel.py "${TK_ARGS[@]}" --out "$OUT_DIR/topk_kernel_gpu.json"
fi
if part moe; then
    step "grouped experts vs sequential and fp32 (pytest $GROUPED_TEST)" 120 \
        env EMPG_GPU_RESULTS_DIR="$OUT_DIR" "$PY" -m pytest -q -rfEs -p no:cacheprovider -m gpu "$GROUPED_TEST"
    pytest_counts
    # expandable segments: less fragmentation for the long-lived states and the experts' varying rows
    step "train_step: MoE (Qwen3-30B-A3B's layers, ${SMOKE_MOE_LAYERS:-4} of 48), grouped vs sequential, sdpa 8k" 300 \
        env PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}" \
        "$PY" benchmarks/train_step.py "${MOE_ARGS[@]}" "${MOE_CASES[@]}" --out "$OUT_DIR/train_step_moe_gpu.json"
fi
if part dense; then
    step "train_step: unfused vs sdpa 2k; sdpa 8k (k3, topk, forward 16k); 16k, 24k full recompute; checkpoint" 310 \
        env PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}" \
        "$PY" benchmarks/train_step.py "${TRAIN_ARGS[@]}" "${TRAIN_CASES[@]}" --out "$OUT_DIR/train_step_gpu.json"
fi
if part lora; then
    step "train_step: LoRA r64 all-linear, sdpa 8k (against the dense part's full fine-tuning)" 150 \
        env PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}" \
        "$PY" benchmarks/train_step.py "${LORA_ARGS[@]}" "${LORA_CASES[@]}" --out "$OUT_DIR/train_step_lora_gpu.json"
fi
if part fp8; then
    step "fp8_anchor: the torch FP8 anchor against bf16, 1.5B dimensions, 4 x 8k packed" 180 \
        "$PY" benchmarks/fp8_anchor.py "${FP8_ARGS[@]}" --out "$OUT_DIR/fp8_anchor_gpu.json"
fi
if part ckpt; then
    step "checkpoint_save --async-save: the 1.5B's state in the background, against a blocking save" 240 \
        "$PY" benchmarks/checkpoint_save.py "${CKPT_ARGS[@]}" --out "$OUT_DIR/checkpoint_save_gpu.json"
fi
if part loop; then
    step "whole_loop: empg train, 3 steps at the 1.5B's dimensions, transformers engine, phases vs the plan" 420 \
        "$PY" benchmarks/whole_loop.py "${LOOP_ARGS[@]}" --out "$OUT_DIR/whole_loop_gpu.json"
fi
if part dense || part moe || part lora; then
    # the memory plan against the peaks just measured (dense and MoE): printed only
    step "plan_vs_gpu (the memory plan against this run's peaks)" 40 \
        "$PY" benchmarks/plan_vs_gpu.py --results "$OUT_DIR" --out ""
fi
if [[ "${SMOKE_KERNELS:-0}" == 1 ]]; then  # (topk_kl.py by hand: the kit's files would pass the tool's 8)
    step "vocab_kernel ${VK_ARGS[*]:0:2}" 90 \
        env "${VK_ENV[@]}" "$PY" benchmarks/vocab_kernel.py "${VK_ARGS[@]}" --out "$OUT_DIR/vocab_kernel_gpu.json"
fi

# ---------------------------------------------------------------- summary (last in the output)
"$PY" - "$OUT_DIR" "$GPU_NAME" "$((SECONDS - START))" "${STEPS[@]}" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path

out, gpu, total, steps = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]


def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None


def gib(n):
    return "-" if n is None else f"{n / 2**30:.1f}"


print(f"\n==================== GPU smoke summary: {gpu}, {total} s ====================")
print(f"{'step':<58} {'status':<22} {'s':>5}")
for s in steps:
    name, status, secs = s.split("|")
    print(f"{name:<58} {status:<22} {secs:>5}")

t = load("topk_kl_gpu.json")
if t:
    cb = (t.get("device_copy_bandwidth") or {}).get("bandwidth_GBps")
    p = t.get("params", {})
    print(f"\ntopk_kl: T={p.get('tokens')} V={p.get('vocab')} k={p.get('k')} chunk={p.get('chunk_size_used')}; "
          f"copy bandwidth {cb and round(cb)} GB/s{' (PARTIAL)' if t.get('partial') else ''}")
    print(f"{'variant':<30} {'T':>6} {'chunk':>6} {'fwd+bwd ms':>11} {'peak+ GiB':>10} {'GB/s':>7} {'%copy':>6}")
    for r in t.get("results", []) + t.get("chunk_sweep", []):
        if not r.get("ok"):
            print(f"{r.get('variant', '?'):<30} {r.get('tokens', ''):>6} {'':>6} "
                  f"{'OOM' if r.get('oom') else 'FAILED':>11}")
            continue
        frac = (r.get("fraction_of_copy_bandwidth") or {}).get("total")
        bw = (r.get("achieved_bandwidth_GBps") or {}).get("total")
        print(f"{r['variant']:<30} {r['tokens']:>6} {r['chunk_size']:>6} {r['time_total_s']['median'] * 1e3:>11.2f} "
              f"{gib(r.get('cuda_peak_extra_bytes', r.get('tracked_peak_bytes'))):>10} "
              f"{'-' if bw is None else f'{bw:.0f}':>7} {'-' if frac is None else f'{100 * frac:.0f}':>6}")
    h = (t.get("comparison") or {}).get("headline")
    if h:
        mem = h.get("peak_extra_mem_ratio_cuda", h.get("peak_extra_mem_ratio_tracked"))
        print(f"headline {h['pair']}: time x{h['time_median_ratio']:.3f}, peak extra memory x{mem if mem is None else round(mem, 4)}")

k = load("vocab_kernel_gpu.json")
if k:
    p, paths, c = k.get("params", {}), k.get("paths") or {}, k.get("check") or {}
    cb = (k.get("copy_bandwidth") or {}).get("bandwidth_GBps")
    print(f"\nvocab_kernel: T={p.get('tokens')} V={p.get('vocab')} M={p.get('ids')} bf16, entropy, in-place; "
          f"launch {k.get('default_launch_config')}; copy bandwidth {cb and round(cb)} GB/s"
          f"{' (PARTIAL)' if k.get('partial') else ''}")
    for mode, x in paths.items():
        t = x["time_ms"]
        print(f"{mode:<8} fwd {t['forward']['median']:8.3f} ms  bwd {t['backward']['median']:8.3f} ms  "
              f"total {t['total']['median']:8.3f} ms  {x['achieved_bandwidth_GBps']['total']:6.0f} GB/s  "
              f"{100 * x['fraction_of_copy_bandwidth']['total']:5.1f}% of copy")
    if c:
        print(f"check vs torch: {'OK' if c.get('ok') else 'MISMATCH'}: max |diff| logprobs "
              f"{c.get('logprobs_max_abs_diff'):.1e}, entropy {c.get('entropy_max_abs_diff'):.1e}, "
              f"grad {c.get('grad_max_abs_diff'):.1e}")
    g = k.get("goal")
    if g:
        print(f"triton x{k['speedup_vs_torch']['total']:.1f} vs torch; {100 * g['achieved']:.1f}% of copy bandwidth "
              f"(goal {100 * g['fraction_of_copy_bandwidth']:.0f}%: {'met' if g['met'] else 'NOT met'})")
    best = min((s for s in k.get("sweep", []) if "error" not in s),
               key=lambda s: s["forward_ms"] + s["backward_ms"], default=None)
    if best:
        print(f"best swept launch: BLOCK {best['block']} warps {best['num_warps']}: "
              f"fwd {best['forward_GBps']:.0f} GB/s, bwd {best['backward_GBps']:.0f} GB/s")
    if k.get("error"):
        print("vocab_kernel error:", k["error"].strip().splitlines()[-1])

t = load("topk_kernel_gpu.json")
if t:
    p, v = t.get("params", {}), t.get("variants") or {}
    print(f"\ntopk_kernel: T={p.get('tokens')} V={p.get('vocab')} k={p.get('k')} bf16, old pass"
          f"{' (PARTIAL)' if t.get('partial') else ''}{'' if t.get('measurement') else ' (CPU flow check)'}")
    print("  ".join(f"{name} {x['time_ms']['median']:.3f} ms" for name, x in v.items()))
    r, c = t.get("ratios"), t.get("check")
    if r:
        print(f"triton_topk / triton_k0 = {r['triton_topk_over_triton_k0']:.2f}, "
              f"torch_topk / triton_topk = {r['torch_topk_over_triton_topk']:.1f}")
    if c:
        print(f"check vs torch: {'OK' if c.get('ok') else 'MISMATCH'}: top-k ids "
              f"{'identical' if c.get('topk_ids_equal') else 'DIFFER'} ({c.get('rows_with_tie_across_kth')} rows tied "
              f"at the k-th place)")
    if t.get("error"):
        print("topk_kernel error:", t["error"].strip().splitlines()[-1])

def train_table(name):
    d = load(name)
    if not d:
        return
    p = d["params"]
    overrides = f" with {', '.join(p['model_override'])}" if p.get("model_override") else ""
    print(f"\ntrain_step ({p.get('model')}{overrides}, {p.get('dtype')}, {p.get('tokens_per_step')} tokens per step, "
          f"commit {d.get('commit')}, peak {p.get('peak_tflops')} TFLOP/s; MFU with causal halving, Megatron's in "
          f"brackets):")
    print(f"{'attention':<9} {'tokens':>6} {'recompute':<9} {'kl':<5} {'tokens/s':>9} {'MFU %':>13} {'step s':>7} "
          f"{'old s':>6} {'peak GiB':>9}")
    for r in d.get("records", []):
        head = f"{r['attention_backend']:<9} {r['tokens_per_microbatch']:>6} {r['recompute']:<9} {r.get('kl', '?'):<5}"
        if not r.get("ok"):
            print(f"{head} {'OOM' if r.get('oom') else 'FAILED':>9} at {r['failed_at']}, peak {r.get('peak_gib') or 0:.1f} GiB")
            continue
        mfu = "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f} ({100 * r['mfu_megatron']:.1f})"
        peak = r.get("peak_gib")
        print(f"{head} {r['tokens_per_s']:>9.0f} {mfu:>13} {r['step_seconds']:>7.3f} "
              f"{r['stage_seconds_median']['old_pass']:>6.3f} {'-' if peak is None else f'{peak:.1f}':>9}")
    c = d.get("checkpoint")
    if c:
        print(f"checkpoint: {c['checkpoint_gb']:.1f} GB in {c['checkpoint_s']:.1f} s; the same bytes written plainly in "
              f"{c['plain_write_s']:.1f} s ({c['write_gb_per_s']:.2f} GB/s): {c['ratio_to_plain_write']:.2f}x")


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}"


def moe_table(name):
    d = load(name)
    if not d:
        return
    p = d["params"]
    print(f"\ntrain_step MoE ({p.get('model')}, {p.get('dtype')}, {p.get('tokens_per_step')} tokens per step, commit "
          f"{d.get('commit')}, peak {p.get('peak_tflops')} TFLOP/s; EP 1 on one GPU: no all-to-all):")
    print(f"{'experts':<10} {'layers':>6} {'tokens':>6} {'steps':>5} {'tokens/s':>9} {'MFU %':>6} {'MoE ms':>8} "
          f"{'MoE MFU %':>9} {'out share %':>11} {'peak GiB':>9} {'plan GiB':>9} {'plan %':>7}")
    for r in d.get("records", []):
        if not r.get("ok"):
            print(f"{r.get('moe_experts') or '?':<10} {'OOM' if r.get('oom') else 'FAILED'} at {r['failed_at']}, "
                  f"peak {r.get('peak_gib') or 0:.1f} GiB: {r.get('error', '')[:200]}")
            continue
        f = r["flops"]
        peak, plan = r.get("peak_gib"), r.get("planned_peak_gib")
        moe_ms = r.get("moe_block_seconds")
        print(f"{r.get('moe_experts') or '-':<10} {r.get('num_layers', '?'):>6} {r['tokens_per_microbatch']:>6} "
              f"{r.get('repeats', '?'):>5} {r['tokens_per_s']:>9.0f} {pct(r.get('mfu')):>6} "
              f"{'-' if moe_ms is None else f'{moe_ms * 1e3:.0f}':>8} {pct(r.get('moe_block_mfu')):>9} "
              f"{pct(f.get('output_layer_share_of_matmul_flops')):>11} {'-' if peak is None else f'{peak:.1f}':>9} "
              f"{'-' if plan is None else f'{plan:.1f}':>9} {pct(r.get('peak_vs_plan')):>7}")
    for c in d.get("moe_comparison", []):
        sp = c.get("moe_block_speedup")
        print(f"grouped / sequential: step x{c['step_speedup']:.2f}, MoE blocks x{'-' if sp is None else f'{sp:.2f}'} "
              f"(timed steps {c['repeats']})")
    g = d.get("goals")
    if g:
        for key in ("step_mfu", "moe_block_mfu", "grouped_over_sequential_moe_blocks", "peak_vs_plan"):
            x = g[key]
            state = "not measured" if x["met"] is None else "met" if x["met"] else "NOT met"
            print(f"goal {key}: {x['value'] if x['value'] is None else round(x['value'], 3)} "
                  f"(target {x['target']}): {state}")


train_table("train_step_gpu.json")
moe_table("train_step_moe_gpu.json")
e = load("grouped_experts_gpu.json")
if e:
    print(f"\ngrouped experts (tests/gpu/test_grouped_experts_gpu.py): {e.get('shape')}; host-sync free: "
          f"{e.get('host_sync_free')}")
    for pair, errors in (e.get("errors") or {}).items():
        print(f"  {pair:<22} " + ", ".join(f"{k} {v['normwise']:.1e}/{v['largest']:.1e}" for k, v in errors.items())
              + "  (normwise/largest)")
    fb = e.get("forward_backward")
    if fb:
        print(f"  forward+backward: grouped {fb['grouped']['seconds'] * 1e3:.2f} ms ({fb['grouped']['tflops']:.0f} "
              f"TFLOP/s), sequential {fb['sequential']['seconds'] * 1e3:.2f} ms: x{fb['grouped_speedup']:.1f}")
f = load("fp8_anchor_gpu.json")
if f:
    print(f"\nfp8 anchor ({f.get('anchor_fp8')}): pass {f['anchor_pass_s'] * 1e3:.1f} ms vs bf16 "
          f"{f['anchor_pass_s_bf16'] * 1e3:.1f} ms (x{f['anchor_pass_speedup']:.2f}); bytes x{f['anchor_bytes_ratio']:.3f} "
          f"(linears x{f['linear_bytes_ratio']:.3f}); log-prob err p99 {f['logprob_err_p99']:.2e}; KL rel. err "
          f"k3 {f['kl_rel_err']['k3']:.2e}, topk {f['kl_rel_err']['topk']:.2e} (drift {f['kl_headline_drift']})")
    o = f.get("output_layer_fp8") or {}
    if o:
        print(f"  with the output layer in FP8: pass x{o['anchor_pass_speedup']:.2f}, bytes x{o['anchor_bytes_ratio']:.3f}, "
              f"KL rel. err k3 {o['kl_rel_err']['k3']:.2e}, topk {o['kl_rel_err']['topk']:.2e}")
    for key, g in f.get("goals", {}).items():
        print(f"  goal {key} {g['goal']}: {'met' if g['met'] else 'NOT met'}")
c = load("checkpoint_save_gpu.json")
if c and "checkpoint_blocking_s" in c:
    slow = c.get("step_slowdown_while_persisting")
    print(f"\ncheckpoint {c['bytes'] / 1e9:.1f} GB: blocking save x{c['ratio_to_plain_write']:.2f} a plain write; "
          f"in the background: blocking {c['checkpoint_blocking_s']:.2f} s (goal 1 s), persist "
          f"{c['checkpoint_persist_s']:.1f} s, step slowdown {'-' if slow is None else f'{100 * slow:.1f} %'} (goal 2 %)")
w = load("whole_loop_gpu.json")
if w:
    print(f"\nwhole loop ({w['steps_logged']} steps): phase, median s, peak GiB, plan GiB, plan vs measured")
    for name, x in w["phases"].items():
        peak, gap = x["peak_bytes"], x["plan_vs_measured"]
        print(f"  {name:<12} {x['seconds_median'] or 0:8.2f} {'-' if peak is None else f'{peak / 2**30:6.1f}'} "
              f"{x['planned_peak_bytes'] / 2**30:6.1f} {'-' if gap is None else f'{100 * gap:+.1f} %'}")
a = load("attention_gpu.json")
if a:
    print(f"\nattention: {a.get('varlen_attn')}, grouped K/V natively: {a.get('varlen_native_gqa')}")
    for layout in ("padded", "packed"):
        for name, errors in ((a.get(layout) or {}).get("relative_errors_out_dq_dk_dv") or {}).items():
            print(f"  {layout:<6} {name:<20} rel. error vs fp32 (out, dq, dk, dv): {', '.join(f'{e:.1e}' for e in errors)}")
print(f"\nfiles in {out}: {', '.join(sorted(p.name for p in out.iterdir() if p.is_file()))}")
EOF

# the device tool returns at most 8 files: past that, the tests' small JSON files travel as one tar
shopt -s nullglob
FILES=("$OUT_DIR"/*)
TEST_JSON=()
for f in smoke_float32.json smoke_bfloat16.json attention_gpu.json cp_attention_gpu.json grouped_experts_gpu.json \
    fp8_anchor_gpu_test.json; do
    [[ -f "$OUT_DIR/$f" ]] && TEST_JSON+=("$f")
done
if ((${#FILES[@]} > 8 && ${#TEST_JSON[@]} > 1)); then
    tar -C "$OUT_DIR" -cf "$OUT_DIR/gpu_tests_json.tar" "${TEST_JSON[@]}" && (cd "$OUT_DIR" && rm -f "${TEST_JSON[@]}")
    log "more than 8 files: ${TEST_JSON[*]} packed into gpu_tests_json.tar (tar xf gpu_tests_json.tar)"
fi
shopt -u nullglob

for s in "${STEPS[@]}"; do  # every step ok, and no test skipped on the GPU machine
    [[ "$s" == *"|ok"* ]] || exit 1
    [[ "$DRY" != 1 && "$s" == *"|ok:"*skipped* ]] && exit 1
done
exit 0
