"""Model helpers shared by both backends and the loop (no backend imports here)."""
