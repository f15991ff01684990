"""RoPE lives in the shared model module, ``diffspec.rope``; these names stay for existing importers."""

from diffspec.rope import RotaryEmbedding, inverse_frequencies

__all__ = ["RotaryEmbedding", "inverse_frequencies"]
