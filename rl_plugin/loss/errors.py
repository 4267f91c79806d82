"""Errors the loss core raises for bad data. Each names the sample (step-local index)."""


class BadBatchError(ValueError):
    """A step's data cannot define the objective (NaN, length mismatch, empty step, ...)."""
