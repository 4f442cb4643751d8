"""LoRA adapters: loading and validation (adapter.py)."""
