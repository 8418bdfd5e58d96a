"""The caffeq version: one place, below every module that records it in a file."""
__version__ = "0.1.0"
