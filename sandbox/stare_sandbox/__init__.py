"""Python execution sandbox service for model-written code (DESIGN section 5).

Deployable on its own (the stare-sandbox distribution, sandbox/pyproject.toml): this package never imports
stare_agent. `python -m stare_sandbox serve` runs the HTTP service (app.py) over a pool of Jupyter kernels
(pool.py, kernel.py, sessions.py) isolated as isolation.py states; client.py has the HTTP clients, inprocess.py
a client with the same interface over a pool in the calling process. docs/sandbox.md lists every module.
"""
