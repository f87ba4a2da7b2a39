"""The types of the errors the jacklring process group raises for a call it refuses, so code
written against gloo catches them as it does gloo's.

gloo refuses a reduce op the dtype cannot take (BAND on floats) or PREMUL_SUM with a
RuntimeError (a c10::Error); jacklring raised ValueError. These classes are both: an `except
ValueError` written against jacklring and an `except RuntimeError` written against gloo
catch them. Failures of the communication itself are DistBackendError already (work.py).
"""
from __future__ import annotations


class InvalidArgument(ValueError, RuntimeError):
    """A collective's arguments jacklring refuses (op, dtype, sizes): a ValueError that is
    also the RuntimeError torch's own backends raise."""


class InvalidArgumentType(TypeError, RuntimeError):
    """A collective's argument of the wrong type: a TypeError that is also a RuntimeError."""
