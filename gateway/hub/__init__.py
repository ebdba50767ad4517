"""The hub: the project's own ALP Server emulator (runner API, Chat Channel, /v1 front door)."""

from gateway.hub.app import App, open_hub, serve_hub
from gateway.hub.board import Job
from gateway.hub.channel import ServerChannel
from gateway.hub.hub import Hub
from gateway.hub.settings import HubSettings
from gateway.hub.store import ApiKey

__all__ = ["ApiKey", "App", "Hub", "HubSettings", "Job", "ServerChannel", "open_hub", "serve_hub"]
