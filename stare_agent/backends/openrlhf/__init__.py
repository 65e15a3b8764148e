"""The OpenRLHF 0.11.2 backend: our pieces plugged into OpenRLHF's Ray/DeepSpeed/vLLM trainers.

Only this package imports openrlhf, vllm, deepspeed or ray (tests/test_imports.py enforces it), and only
in the modules that need them. The STARE step itself is the shared `stare_agent.step`, as in the local backend.
"""
