"""alp-gateway: a Kind B (``chat-llm:v1``) Runner for the ALP platform."""

__version__ = "0.1.0"
