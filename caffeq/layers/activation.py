"""activation layer specs."""
