"""The old home of the runner's spans, kept only for two type-checking imports: see ``gateway.runner.otel``.

``gateway/runner/turn.py`` and ``gateway/runner/channel.py`` still name ``gateway.ops.otel`` under
``if TYPE_CHECKING:`` (they are being reworked elsewhere); once they name ``gateway.runner.otel``,
delete this module and its entry in ``tests/test_layout.py``'s ``_UPWARD_PENDING``. Nothing
imports it at run time.
"""

from gateway.runner.otel import SessionTrace, Tracing, TurnTrace

__all__ = ["SessionTrace", "Tracing", "TurnTrace"]
