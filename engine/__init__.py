"""The inference engine: model, paged KV cache, scheduler, sampler, worker and client."""

import os

# Triton fixes, when it is first imported, whether its kernels compile or run under its
# interpreter. With no GPU driver on the machine only the interpreter can run them (tests,
# `--backend triton` on CPU), so choose it before anything imports Triton.
if "TRITON_INTERPRET" not in os.environ and not any(
    os.path.exists(dev) for dev in ("/dev/nvidiactl", "/dev/kfd")
):
    os.environ["TRITON_INTERPRET"] = "1"
