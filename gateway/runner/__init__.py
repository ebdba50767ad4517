"""The Runner: the supervisor (registration, the poll loop, claims), a session's life, its
Chat Channel, the relay of a backend's stream, and the backend pool."""
