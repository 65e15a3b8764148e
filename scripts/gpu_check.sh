#!/usr/bin/env bash
# GPU check: does this machine run the pipeline on CUDA? Prints PASS/FAIL and the measured tokens/s.
#
#   scripts/gpu_check.sh [key=value ...]      # overrides go to `stare-agent quickstart`
#
# 1. The local backend's quickstart at its own size (tiny model, synthetic tasks: SFT, GRPO-ds and STARE RL,
#    three evaluations) with every stage on $GPU_CHECK_DEVICE. PASS needs exit code 0, a wall time under
#    $GPU_CHECK_LIMIT_S (480 s = 8 min), SFT loss falling, every RL step logged, updates with a finite loss
#    (and stare/* in the STARE run), and every eval's results.json (scripts/gpu_check.py reads them).
# 2. Only where `import openrlhf, vllm, deepspeed, ray` works: an OpenRLHF RL run (backend openrlhf) of the
#    quickstart's SFT model on its prompts at the paper configs' placement reduced to one GPU (ZeRO-3, actor and
#    engine colocated with CUDA-IPC weight sync and both sleep modes, prefix caching; 3 steps), after a --dry-run
#    of the same command (with GPU_CHECK_DEVICE=cpu the dry run only). scripts/gpu_check.py --openrlhf judges it:
#    FAIL on a non-zero exit, fewer steps trained than asked (none included), no final Hugging Face model, or an
#    engine whose log-probs of the sampled tokens drift from the trainer's after step 1 (its weights did not change
#    at the sync). The overall result fails if this stage fails.
#
# Needs only Python 3.10+ with PyTorch (CUDA build) and transformers: the repository is installed with
# `pip install -e .` if `stare_agent` does not import. No network besides PyPI for that install, no weights
# downloaded (the model is built locally). Each run writes to a new folder (printed first), so it is safe to
# run twice. Environment:
#   GPU_CHECK_DEVICE  cuda (default) or cpu: cpu checks the plumbing on a machine without a GPU
#   GPU_CHECK_SIZE    full (default with cuda: the quickstart's size) or small (default with cpu: a few steps)
#   GPU_CHECK_DIR     the folder for logs and runs (default runs/gpu-check-<UTC time>)
#   GPU_CHECK_LIMIT_S the wall-time limit of step 1 in seconds (default 480)
#   PYTHON            the interpreter (default: python3)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

python=${PYTHON:-python3}
device=${GPU_CHECK_DEVICE:-cuda}
if [ "$device" = cpu ]; then size=${GPU_CHECK_SIZE:-small}; else size=${GPU_CHECK_SIZE:-full}; fi
limit=${GPU_CHECK_LIMIT_S:-480}
out=${GPU_CHECK_DIR:-runs/gpu-check-$(date -u +%Y%m%d-%H%M%S)}
if [ -e "$out/quickstart" ]; then
    echo "gpu_check: $out/quickstart exists; set GPU_CHECK_DIR to a new folder" >&2
    exit 2
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
echo "gpu_check: logs and runs in $out"

if ! "$python" -c "import stare_agent" 2>/dev/null; then
    echo "gpu_check: installing this repository (pip install -e .) ..."
    if ! "$python" -m pip install -e . > "$out/pip-install.log" 2>&1; then
        echo "gpu_check: FAIL: pip install -e . (see $out/pip-install.log)"
        exit 1
    fi
fi
"$python" - "$device" <<'PY' 2>&1 | tee "$out/environment.txt"
import sys, platform, torch, transformers
device = sys.argv[1]
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}")
if device.startswith("cuda"):
    if not torch.cuda.is_available():
        sys.exit("gpu_check: FAIL: torch.cuda.is_available() is False (a CPU build of torch, or no driver)")
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} visible")
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

# the quickstart's stages each take their own model.device; a small size only for checking the plumbing
args=(run.output_dir="$out" run.name=quickstart sft.model.device="$device" rl.model.device="$device"
      eval.model.device="$device")
if [ "$size" = small ]; then
    args+=(tasks.sft_examples=64 tasks.rl_prompts=64 tasks.test_problems=4 sft.epochs=2 sft.log_every=1
           sft.optim.warmup_steps=2 rl.steps=2 rl.rollout.prompts_per_step=2 rl.rollout.group_size=4
           rl.rollout.batch_size=8 rl.rollout.dynamic_sampling=false eval.k=2)
    # (a model this briefly trained mostly gets equal rewards in a group; without dynamic sampling such a
    # group is kept with zero advantages, so each step still runs the update and logs stare/*)
fi

echo "gpu_check 1/2: the local quickstart on $device ($size size), limit ${limit} s; log: $out/quickstart.log"
started=$(date +%s)
timeout --signal=TERM "$((limit + 60))" "$python" -m stare_agent.cli quickstart "${args[@]}" "$@" \
    > "$out/quickstart.log" 2>&1
rc=$?
wall=$(( $(date +%s) - started ))
"$python" scripts/gpu_check.py "$out/quickstart" --exit-code "$rc" --wall-s "$wall" --limit-s "$limit" \
    | tee "$out/verdict.txt"
local_ok=${PIPESTATUS[0]}

orl_ok=0
if "$python" -c "import openrlhf, vllm, deepspeed, ray" > "$out/openrlhf-import.log" 2>&1; then
    echo "gpu_check 2/2: OpenRLHF RL at the paper configs' placement, reduced to 1 GPU; log: $out/openrlhf.log"
    rl_config="$out/quickstart/rl-stare-O1/config.yaml"  # the quickstart's resolved RL config (model, data, agent)
    # steps, ZeRO-3, colocated actor and engine (CUDA-IPC sync), both sleep modes, prefix caching, a learning
    # rate at which a failed sync shows: one list, in scripts/gpu_check.py (OPENRLHF_SHAPE)
    mapfile -t shape < <("$python" scripts/gpu_check.py --openrlhf-overrides)
    steps=${shape[0]#steps=}
    orl=(--config "$rl_config" backend=openrlhf run.output_dir="$out" run.name=openrlhf-rl model.device=auto
         model.dtype=bfloat16 rollout.prompts_per_step=4 rollout.group_size=4 rollout.dynamic_sampling=true
         openrlhf.actor.num_nodes=1 openrlhf.actor.num_gpus_per_node=1 openrlhf.vllm.num_engines=1
         openrlhf.vllm.tensor_parallel_size=1 openrlhf.vllm.gpu_memory_utilization=0.3 loss.micro_batch_size=4
         openrlhf.rollout.micro_batch_size=4 "${shape[@]}")
    # OpenRLHF's trainers need CUDA (on a CPU its Ray actors wait for a GPU forever): there, the dry run only
    started=$(date +%s)
    "$python" -m stare_agent.cli rl "${orl[@]}" --dry-run > "$out/openrlhf.log" 2>&1
    orl_rc=$?
    if [ "$orl_rc" -ne 0 ]; then
        tail -n 3 "$out/openrlhf.log" | cut -c1-300 | sed 's/^/  /'
        echo "OpenRLHF command: FAIL (--dry-run exit $orl_rc; see $out/openrlhf.log)"; orl_ok=1
    elif [ "$device" = cpu ]; then
        echo "OpenRLHF command (--dry-run only: OpenRLHF trains on CUDA): PASS"
    else
        timeout --signal=TERM 1200 "$python" -m stare_agent.cli rl "${orl[@]}" >> "$out/openrlhf.log" 2>&1
        orl_rc=$?
        wall=$(( $(date +%s) - started ))
        tail -n 3 "$out/openrlhf.log" | cut -c1-300 | sed 's/^/  /'
        echo "  wall ${wall} s"
        # FAIL: a non-zero exit, fewer than $steps steps trained, no final Hugging Face model, or engine log-probs
        # that drift from the trainer's after step 1 (the weight sync did not reach the engine)
        "$python" scripts/gpu_check.py "$out/openrlhf-rl" --exit-code "$orl_rc" --openrlhf "$steps" \
            | tee "$out/openrlhf-verdict.txt"
        orl_ok=${PIPESTATUS[0]}
    fi
else
    echo "gpu_check 2/2: skipped: OpenRLHF's stack does not import here (scripts/install_gpu.sh installs it):"
    tail -n 1 "$out/openrlhf-import.log" | sed 's/^/  /'
fi

if [ "$local_ok" -eq 0 ] && [ "$orl_ok" -eq 0 ]; then result=PASS; else result=FAIL; fi
echo "gpu_check: $result (details in $out)"
[ "$result" = PASS ]
