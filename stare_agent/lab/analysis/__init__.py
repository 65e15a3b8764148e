"""Analysis tools over finished runs and evaluations, each `main(argv)`: `stare-agent lab TOOL [args]`."""

TOOLS = (
    "rl_experiment",
    "rl_diagnostics",
    "paired_evals",
    "endpoint",
    "program_styles",
    "heldout_noise",
    "w_modes_toy",
    "calibrate_control",
)
