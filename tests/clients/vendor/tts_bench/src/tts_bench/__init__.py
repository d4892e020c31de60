"""Asyncio open-loop benchmark for streaming text-to-speech servers."""

__version__ = "0.1.0"
