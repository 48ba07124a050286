"""firstbyte's benchmarks: transports, router overhead, routing, across emulated geographies."""
