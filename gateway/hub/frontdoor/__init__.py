"""The hub's OpenAI-compatible front door (``/v1``): chat sessions over Chat Jobs, each turn relayed
down its session's channel, and the models the project's runners serve."""

from gateway.hub.frontdoor.door import FrontDoor

__all__ = ["FrontDoor"]
