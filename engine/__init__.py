"""The inference engine: model, paged KV cache, scheduler, sampler, worker and client."""
