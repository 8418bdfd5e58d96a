"""recurrent layer specs."""
