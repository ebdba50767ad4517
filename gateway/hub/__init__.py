"""The hub: the project's own ALP Server emulator (runner API, Chat Channel, /v1 front door)."""

from gateway.hub.core import ApiKey, Hub, Job, ServerChannel, open_hub, serve_hub

__all__ = ["ApiKey", "Hub", "Job", "ServerChannel", "open_hub", "serve_hub"]
