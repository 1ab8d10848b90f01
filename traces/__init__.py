"""Trace format v1 (reader, writer, checks) and the synthetic trace generator."""

from moesim.traces.format import FORMAT, VERSION, Trace, read_trace, write_trace

__all__ = ["FORMAT", "VERSION", "Trace", "read_trace", "write_trace"]
