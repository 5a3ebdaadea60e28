"""The bus: the NATS connection, its subjects, the typed messages on it and their checker."""
