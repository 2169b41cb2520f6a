"""Readers and writers for the files of the PowerInfer contract (shared/FORMATS.md)."""
