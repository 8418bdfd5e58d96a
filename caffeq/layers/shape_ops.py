"""shape_ops layer specs."""
