"""misc layer specs."""
