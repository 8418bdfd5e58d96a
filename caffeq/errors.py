"""Errors that users see as one line: `caffeq: error: <message>`, exit status 2."""


class CaffeqError(Exception):
    """Base class of every error caused by user input (files, flags, models)."""


class ParseError(CaffeqError):
    """A prototxt or binary file that cannot be read."""


class WeightsError(CaffeqError):
    """Weights missing, mis-shaped or corrupt."""


class UnsupportedLayerError(CaffeqError):
    """Layer types caffeq has no spec for (all listed at once)."""


class ShapeError(CaffeqError):
    """Shapes that Caffe would reject, or that are absurd."""


class GraphError(CaffeqError):
    """Undefined bottoms, duplicate names and other structural problems."""


class DataError(CaffeqError):
    """Datasets, mean files and inputs that cannot be used."""


class ExportError(CaffeqError):
    """A model that a backend cannot express."""
