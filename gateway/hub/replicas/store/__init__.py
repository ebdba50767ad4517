"""What the replicas keep in their shared PostgreSQL store: its records and interface (``base``),
its tables (``schema``, migrations 5 and 9 of ``gateway.hub.store.schema``), its statements
(``ops``, ``usage``) and their runner on the store's pool (``postgres``)."""
