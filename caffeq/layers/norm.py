"""norm layer specs."""
