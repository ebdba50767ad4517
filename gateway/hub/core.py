"""The old import path of ``serve_hub`` (bench/hubproc.py uses it); new code imports ``gateway.hub``."""

from gateway.hub.app import serve_hub

__all__ = ["serve_hub"]
