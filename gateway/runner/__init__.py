"""The Runner: the supervisor (registration, the poll loop, claims), its saved registration, a
session's life, its Chat Channel, the relay of a backend's stream, and the backend pool."""
