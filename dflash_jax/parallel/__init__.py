"""Meshes and shardings: logical-axis rules for the weights and caches, placement, HLO collective counts."""
