"""Bytes on disk: the manifest and the tensor file format."""
