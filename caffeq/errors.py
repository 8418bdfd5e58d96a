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


class PhaseRuleError(GraphError):
    """An undefined bottom that a layer left out by the phase/stage rules would produce.

    `rule` is that layer's first include rule (a NetStateRule) or None: the state under which
    the net is whole (inspect reads the net so)."""

    def __init__(self, message, rule=None):
        super().__init__(message)
        self.rule = rule


class DataError(CaffeqError):
    """Datasets, mean files and inputs that cannot be used."""


class ExportError(CaffeqError):
    """A model that a backend cannot express."""
