"""vision_forks layer specs."""
