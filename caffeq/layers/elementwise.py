"""elementwise layer specs."""
