"""Provider adapters: one module per wire API."""
