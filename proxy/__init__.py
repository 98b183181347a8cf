"""HTTP side of ctxgate: routes, tenancy, config, forwarding, state."""
