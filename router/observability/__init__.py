"""What the router tells its operator: logs (:mod:`.logs`), one access record per request
(:mod:`.access`) and OTLP traces (:mod:`.traces`, the ``otel`` extra, imported only when
configured)."""
