"""Structured outputs: the output constraints (JSON mode, JSON Schema, regex, Lark grammar) the engine decodes
under, exactly (:mod:`speculant.core.constraint`), on llguidance. :func:`compile_response_format` turns a
``response_format`` dict into a :class:`CompiledFormat`, whose :meth:`~CompiledFormat.constraint` is one
generation's :class:`~speculant.core.constraint.Constraint`."""

from .formats import FORMAT_TYPES, CompiledFormat, compile_response_format
from .guidance import GuidanceConstraint

__all__ = ["FORMAT_TYPES", "CompiledFormat", "GuidanceConstraint", "compile_response_format"]
