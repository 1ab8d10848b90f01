"""Trace format (version 2; version 1 still read): reader, writer, checks, typed header, record codec, and the synthetic trace generator."""

from moesim.traces.format import FORMAT, VERSION, Trace, read_trace, write_trace

__all__ = ["FORMAT", "VERSION", "Trace", "read_trace", "write_trace"]
