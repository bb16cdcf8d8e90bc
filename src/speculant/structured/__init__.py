"""Structured outputs: constrained decoding and tool calls."""
