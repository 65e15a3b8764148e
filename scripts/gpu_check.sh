#!/usr/bin/env bash
# GPU check: does this machine run the pipeline on CUDA? Prints PASS/FAIL and the measured tokens/s.
#
#   scripts/gpu_check.sh [key=value ...]      # overrides go to `stare-agent quickstart`
#
# 1. The local backend's quickstart at its own size (tiny model, synthetic tasks: SFT, GRPO-ds and STARE RL,
#    three evaluations) with every stage on $GPU_CHECK_DEVICE. PASS needs exit code 0, a wall time under
#    $GPU_CHECK_LIMIT_S (480 s = 8 min), SFT loss falling, every RL step logged, updates with a finite loss
#    (and stare/* in the STARE run), and every eval's results.json (scripts/gpu_check.py reads them).
# 2. Only where `import openrlhf, vllm, deepspeed, ray` works: OpenRLHF RL (backend openrlhf) of the quickstart's
#    SFT model on its prompts at the paper configs' shape reduced to one GPU (ZeRO-3, actor and engine colocated
#    with CUDA-IPC weight sync, both sleep modes, prefix caching, gradient checkpointing, and flash_attention_2 where
#    flash_attn imports, else sdpa: it says which), after a --dry-run of both commands (with GPU_CHECK_DEVICE=cpu
#    the dry runs only). Two runs of one folder, as a long run is stopped and resumed: steps 1-2 with a save at
#    step 2, then the same command with steps=3 resume=auto. As root, both run as $GPU_CHECK_USER (default nobody)
#    through setpriv, so the sandbox kernels inside the vLLM engine run without root as on a cluster; where that user
#    cannot run it (a probe: this Python, the repository and the model readable, the GPU visible), as root, and the
#    verdict says the non-root check was skipped and why. scripts/gpu_check.py judges it from the runs' own files:
#    FAIL on a non-zero exit, a step not trained or trained twice, a resumed run that did not train exactly step 3
#    from the step-2 checkpoint, no final Hugging Face model, an engine whose log-probs of the sampled tokens drift
#    from the trainer's after step 1 (its weights did not change at the sync; step 1's absolute gap is printed next
#    to the bound), a config.yaml without the stage's settings (the attention it records is printed), or, without
#    root, files of another user or a policy that never called the sandbox. The overall result fails if it fails.
#
# Needs only Python 3.10+ with PyTorch (CUDA build) and transformers: the repository is installed with
# `pip install -e .` if `stare_agent` does not import. No network besides PyPI for that install, no weights
# downloaded (the model is built locally). Each run writes to a new folder (printed first), so it is safe to
# run twice. Environment:
#   GPU_CHECK_DEVICE  cuda (default) or cpu: cpu checks the plumbing on a machine without a GPU
#   GPU_CHECK_SIZE    full (default with cuda: the quickstart's size) or small (default with cpu: a few steps)
#   GPU_CHECK_DIR     the folder for logs and runs (default runs/gpu-check-<UTC time>)
#   GPU_CHECK_LIMIT_S the wall-time limit of step 1 in seconds (default 480)
#   GPU_CHECK_USER    as root: the user stage 2's RL runs as (default nobody; root keeps root)
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
    echo "gpu_check 2/2: OpenRLHF RL at the paper configs' shape, reduced to 1 GPU, in two runs (a save, a resume)"
    rl_config="$out/quickstart/rl-stare-O1/config.yaml"  # the quickstart's resolved RL config (model, data, agent)
    run_dir="$out/openrlhf-rl"
    # The steps, the step the first run saves at, ZeRO-3, colocated actor and engine (CUDA-IPC sync), both sleep
    # modes, prefix caching, gradient checkpointing, the attention (flash_attention_2 where flash_attn imports, else
    # sdpa: it says which, and why, on stderr), a learning rate at which a failed sync shows: one list, in
    # scripts/gpu_check.py (OPENRLHF_SHAPE)
    mapfile -t shape < <("$python" scripts/gpu_check.py --openrlhf-overrides 2> "$out/attention.txt")
    sed 's/^gpu_check: /  /' "$out/attention.txt"
    steps=${shape[0]#steps=}
    saved_at=${shape[1]#save_every=}
    attention=sdpa
    for word in "${shape[@]}"; do
        case $word in openrlhf.ds.attn_implementation=*) attention=${word#*=} ;; esac
    done

    # The RL runs without root, so the sandbox kernels in its vLLM engines do too, as on a cluster (the sandbox
    # isolates them differently with and without root: docs/sandbox.md). As root: as $GPU_CHECK_USER (default
    # nobody) through setpriv, with a HOME and a Ray folder of its own, once a probe shows that user can run it
    # (reads this Python, the repository and the model, sees the GPU, writes the run folder); otherwise as root,
    # and the verdict says the non-root check was skipped and why.
    run_uid=$(id -u)
    root_reason=""
    as_user=(env)
    if [ "$run_uid" -eq 0 ]; then
        user=${GPU_CHECK_USER:-nobody}
        if [ "$user" = root ]; then
            root_reason="GPU_CHECK_USER=root"
        elif ! command -v setpriv > /dev/null; then
            root_reason="setpriv (util-linux) is not installed, so root cannot be dropped"
        elif ! id -u "$user" > /dev/null 2>&1; then
            root_reason="there is no user $user to run it as (set GPU_CHECK_USER to one)"
        else
            uid=$(id -u "$user")
            gid=$(id -g "$user")
            home="$out/home-$user"
            ray_tmp=$(mktemp -d /tmp/gpu-check-ray.XXXXXX)  # short: Ray's socket paths must fit in 107 bytes
            mkdir -p "$home" "$run_dir"
            chown "$uid:$gid" "$home" "$run_dir" "$ray_tmp"
            # USER and LOGNAME too: torch's compile caches are named after getpass.getuser(), which reads them
            as_user=(setpriv --reuid="$uid" --regid="$gid" --init-groups
                     env HOME="$home" USER="$user" LOGNAME="$user" RAY_TMPDIR="$ray_tmp")
            probe_log="$out/unprivileged-probe.log"
            if "${as_user[@]}" "$python" - "$device" "$rl_config" "$run_dir" > "$probe_log" 2>&1 <<'PY'
import pathlib, sys

import deepspeed, openrlhf, ray, stare_agent, torch, vllm, yaml

device, config, run_dir = sys.argv[1:]
if device.startswith("cuda") and not torch.cuda.is_available():
    sys.exit("torch.cuda.is_available() is False for this user (no access to /dev/nvidia*?)")
if pathlib.Path(config).is_file():  # else the quickstart failed, and the dry run says so
    model = pathlib.Path(yaml.safe_load(pathlib.Path(config).read_text())["model"]["path"])
    (model / "config.json").read_bytes()
probe = pathlib.Path(run_dir) / ".probe"
probe.write_text("")
probe.unlink()
PY
            then
                run_uid=$uid
            else
                root_reason="$user (uid $uid) cannot run it: $(tail -n 1 "$probe_log" | cut -c1-200)"
                as_user=(env)
                rm -rf "$home"
                chown "$(id -u):$(id -g)" "$run_dir"
            fi
        fi
    fi
    if [ -n "$root_reason" ]; then
        echo "  runs as root (the in-engine sandbox is not checked without root): $root_reason"
    else
        echo "  runs as uid $run_uid ($(id -nu "$run_uid" 2>/dev/null)): the in-engine sandbox's kernels without root"
    fi

    orl=(--config "$rl_config" backend=openrlhf run.output_dir="$out" run.name=openrlhf-rl model.device=auto
         model.dtype=bfloat16 rollout.prompts_per_step=4 rollout.group_size=4 rollout.dynamic_sampling=true
         openrlhf.actor.num_nodes=1 openrlhf.actor.num_gpus_per_node=1 openrlhf.vllm.num_engines=1
         openrlhf.vllm.tensor_parallel_size=1 openrlhf.vllm.gpu_memory_utilization=0.3 loss.micro_batch_size=4
         openrlhf.rollout.micro_batch_size=4 "${shape[@]:2}")
    # two runs of one folder: the first trains steps 1..saved_at and saves there, the second resumes from that save
    # (the quickstart's config has resume=auto; the first run starts afresh in any case)
    first=("${orl[@]}" steps="$saved_at" save_every="$saved_at" resume=)
    resumed=("${orl[@]}" steps="$steps" save_every="$saved_at" resume=auto)
    # OpenRLHF's trainers need CUDA (on a CPU its Ray actors wait for a GPU forever): there, the dry runs only
    "${as_user[@]}" "$python" -m stare_agent.cli rl "${first[@]}" --dry-run > "$out/openrlhf.log" 2>&1 \
        && "${as_user[@]}" "$python" -m stare_agent.cli rl "${resumed[@]}" --dry-run >> "$out/openrlhf.log" 2>&1
    orl_rc=$?
    if [ "$orl_rc" -ne 0 ]; then
        tail -n 3 "$out/openrlhf.log" | cut -c1-300 | sed 's/^/  /'
        echo "OpenRLHF command: FAIL (--dry-run exit $orl_rc; see $out/openrlhf.log)"; orl_ok=1
    elif [ "$device" = cpu ]; then
        echo "OpenRLHF command (--dry-run only: OpenRLHF trains on CUDA): PASS"
    else
        judge=("$run_dir" --openrlhf "$steps" --resumed-from "$saved_at" --attention "$attention"
               --run-uid "$run_uid" --root-reason "$root_reason")
        run_rl() {  # NAME, then the command's words: one RL run, logged to openrlhf-NAME.log; sets orl_rc
            local name=$1 started
            shift
            echo "  the $name run; log: $out/openrlhf-$name.log"
            started=$(date +%s)
            timeout --signal=TERM 1200 "${as_user[@]}" "$python" -m stare_agent.cli rl "$@" \
                > "$out/openrlhf-$name.log" 2>&1
            orl_rc=$?
            tail -n 2 "$out/openrlhf-$name.log" | cut -c1-300 | sed 's/^/    /'
            echo "    exit $orl_rc, wall $(( $(date +%s) - started )) s"
        }
        run_rl first "${first[@]}"
        judge+=(--first-exit-code "$orl_rc")
        if [ "$orl_rc" -eq 0 ]; then  # else nothing to resume from: the verdict says the resumed run did not start
            run_rl resumed "${resumed[@]}"
            judge+=(--exit-code "$orl_rc")
        fi
        # FAIL: a non-zero exit, a step not trained or trained twice, a resumed run that did not start from step
        # $saved_at's checkpoint, no final Hugging Face model, engine log-probs that drift from the trainer's after
        # step 1 (the weight sync did not reach the engine), a setting the run did not get, or a non-root run whose
        # policy never called the sandbox
        "$python" scripts/gpu_check.py "${judge[@]}" | tee "$out/openrlhf-verdict.txt"
        orl_ok=${PIPESTATUS[0]}
    fi
    [ -z "${ray_tmp:-}" ] || rm -rf "$ray_tmp"
else
    echo "gpu_check 2/2: skipped: OpenRLHF's stack does not import here (scripts/install_gpu.sh installs it):"
    tail -n 1 "$out/openrlhf-import.log" | sed 's/^/  /'
fi

if [ "$local_ok" -eq 0 ] && [ "$orl_ok" -eq 0 ]; then result=PASS; else result=FAIL; fi
echo "gpu_check: $result (details in $out)"
[ "$result" = PASS ]
