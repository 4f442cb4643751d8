"""Pure admission and ordering decisions (token buckets, KV budgets, fair share)."""
