"""The hub's OpenAI-compatible front door (/v1): chat sessions, turns, models."""

from gateway.hub.frontdoor.door import FrontDoor

__all__ = ["FrontDoor"]
