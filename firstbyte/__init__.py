"""firstbyte: take the network out of an LLM application's latency budget."""
