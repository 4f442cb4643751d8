"""Tenants, API keys, policies as records, the usage ledger and the store connection."""
