"""LoRA adapters: PEFT loading and validation (adapter.py), adapter slots and the batched
projections (layers.py), seeded random adapters for tests and benchmarks (synthetic.py)."""
