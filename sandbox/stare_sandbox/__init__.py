"""Python execution sandbox service for model-written code (DESIGN section 5).

Deployable on its own (the stare-sandbox distribution, sandbox/pyproject.toml): this package never imports
stare_agent. `python -m stare_sandbox serve` runs the HTTP service (app.py) over a pool of Jupyter kernels
(kernels.py) isolated as isolation.py states; client.py has the HTTP clients and an in-process client with the
same interface.
"""
