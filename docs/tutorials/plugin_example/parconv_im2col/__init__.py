"""parconv-im2col: an example parconv backend whose convolutions are one matrix product."""

from .backend import Im2colBackend

__all__ = ["Im2colBackend"]
