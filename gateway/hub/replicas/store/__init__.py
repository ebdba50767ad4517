"""What the replicas keep in their shared PostgreSQL store: its records and interface (``base``),
its tables (``gateway.hub.store.replica_schema``, migrations 5, 8, 9 and 10), its statements
(``ops``, ``usage``) and their runner on the store's pool (``postgres``)."""
