"""Settings shared by the tests that run a whole (very small) quickstart or experiment."""

# A quickstart (or experiment) small enough for a test: a 1-layer model, 16 transcripts, 2 RL steps of 2 x 2.
TINY_QUICKSTART = [
    "model.hidden_size=64",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=128",
    "model.num_layers=1",
    "tasks.sft_examples=16",
    "tasks.rl_prompts=24",
    "tasks.test_problems=3",
    "sft.epochs=1",
    "sft.micro_batch_size=8",
    "rl.steps=2",
    "rl.rollout.prompts_per_step=2",
    "rl.rollout.group_size=2",
    "rl.rollout.max_turn_tokens=24",
    "rl.rollout.dynamic_sampling=false",
    "eval.max_turn_tokens=24",
]
