"""The decoding core: data types, sampling, the one verifier, tree attention, the cache seam, the engine and the
target's forward (the Llama forward, packed and quantized weights)."""
