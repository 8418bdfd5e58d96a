"""ssd layer specs."""
