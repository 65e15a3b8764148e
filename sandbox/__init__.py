"""Python execution sandbox service for model-written code (DESIGN section 5).

Deployable on its own: this package never imports stare_agent. The service itself is not in this
version yet; `stare-agent sandbox` says so.
"""
