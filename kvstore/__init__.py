"""Paged KV storage: page format, tier pools and the copies between them."""
