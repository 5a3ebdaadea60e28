"""Discovery: workers announce themselves and their load; the gateway keeps the registry."""
