"""Models the runtime is exercised with."""
