"""The hub as one of several replicas on one PostgreSQL store, behind a load balancer: each job
claimed once whatever replica a runner reaches, every replica's memory kept in step by the
store's notifications, a turn served by the replica its client reached through the replica
that holds its session's channel, and the API keys' limits counted in the store."""
