"""Re-export the simulator's public API: an OpenAI-compatible model server for tests and benchmarks."""

from gateway.sim.server import (
    DIALECTS,
    EMBEDDING_DIMENSIONS,
    FAULTS,
    WORDS,
    RecordedRequest,
    SimOptions,
    Simulator,
    StreamRecord,
    embedding_of,
    open_sim,
    serve_sim,
    token_text,
)

__all__ = [
    "DIALECTS",
    "EMBEDDING_DIMENSIONS",
    "FAULTS",
    "WORDS",
    "RecordedRequest",
    "SimOptions",
    "Simulator",
    "StreamRecord",
    "embedding_of",
    "open_sim",
    "serve_sim",
    "token_text",
]
