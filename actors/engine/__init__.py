"""The decoding engine: model, KV cache, runner, scheduler, sampling, verifier, LLMEngine."""
