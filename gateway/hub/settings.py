"""The hub's settings (``HubSettings``, which every part reads), declared in ``gateway.config``.

Each field is declared once there, with the runner's settings (type, default, flag, environment
variable, TOML key, help): ``alp-gateway hub``'s flags, its ``--config`` file, its help and the
docs all come from that declaration. A part of the hub imports it from here.
"""

from __future__ import annotations

from gateway.config import HubSettings

__all__ = ["HubSettings"]
