"""Tenant-policy decisions: admission (`admission.py`: a request's rate, token, concurrency
and KV-budget allowances reserved, renewed and released by Lua scripts that run atomically
in the shared store, through a client the caller hands in) and a verdict's rate-limit headers
(`headers.py`, pure). It opens no connection, reads no settings and imports only tenants'
policy records."""
