"""The hub's front door (/v1): the routes, and each API's request and answer as one chat turn."""
