"""looptool's fused ops (``torch.library`` custom ops with reference and fake kernels)."""
