"""Parsers of model output text: reasoning (`<think>...</think>`) and tool calls."""
